"""Attention as operators the capture records instead of what transformers would build around it.

    window.py   megacompile::window_attention and its backward: causal attention over a sliding
                window of keys and within packed documents, with no [S, S] mask anywhere
                (capture/hf_windows.py routes transformers' masks of that form here)
"""
