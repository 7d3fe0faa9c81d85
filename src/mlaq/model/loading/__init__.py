"""Reading a checkpoint into the layers: safetensors files (whole or by byte range), weight formats,
kv_b_proj's split into W_UK / W_UV and its checks, the per-layer source, ``load_model``."""
