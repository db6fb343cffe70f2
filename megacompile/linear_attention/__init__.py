"""Linear attention as operators the capture records instead of what transformers runs op by op.

    delta_rule.py   megacompile::chunk_gated_delta_rule and its backward: Qwen3-Next's and
                    Qwen3.5's gated delta rule run through the model's own function, one operator
                    a layer that keeps only its inputs for the backward
                    (capture/hf_delta_rule.py routes transformers' calls here)
"""
