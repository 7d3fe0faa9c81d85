"""Models: MLA attention, DeepSeek-V3-family decoder layers, MoE, MTP, checkpoint loading."""
