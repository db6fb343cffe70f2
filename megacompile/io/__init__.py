"""Weights in and out: checkpoint folders (checkpoint.py), Hugging Face model folders read
straight into the host masters (hf_load.py) and written from them (hf_save.py). Every path
streams one tensor at a time; nothing holds a second copy of the host state."""
