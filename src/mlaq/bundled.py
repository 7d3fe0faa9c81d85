"""The checkpoints shipped inside the package (``mlaq/assets/NAME``) and which one every command defaults to.

``DEFAULT_MODEL`` is what ``mlaq validate``, ``explain``, ``generate`` and ``serve`` run when no MODEL is
given: mlaq-tiny-4k, a trained DeepSeek-V3 with DeepSeek-V3's real per-head MLA geometry (kv_lora_rank
512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128), one MTP layer and a 4096-token context.
The older mlaq-tiny (kv_lora_rank 128, rope 32, context 2048) stays shipped and loadable by path or by
name (``bundled_model_dir("mlaq-tiny")``); it is no longer the default. mlaq-tiny-16k is mlaq-tiny-4k
extended to 16,384 tokens with DeepSeek-V3's YaRN (``bundled_model_dir("mlaq-tiny-16k")``).

No heavy imports here: the command-line parser and ``mlaq explain`` (config files only) read this.

>>> bundled_model_dir().name
'mlaq-tiny-4k'

Every command's MODEL also takes a bundled model's name (``mlaq validate mlaq-tiny-16k``); a local
directory of the same name wins.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "mlaq-tiny-4k"
# every checkpoint under mlaq/assets, default first
BUNDLED_MODELS = (DEFAULT_MODEL, "mlaq-tiny", "mlaq-tiny-16k")
EVAL_TEXT_NAME = "heldout.txt"  # the held-out evaluation text shipped beside a bundled checkpoint


def bundled_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """The directory of the bundled checkpoint ``name``; a clear error if unknown or not installed."""
    if name not in BUNDLED_MODELS:
        raise ValueError(f"no bundled model {name!r}; bundled: {', '.join(BUNDLED_MODELS)}")
    path = Path(str(resources.files("mlaq"))) / "assets" / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the bundled model {name} is not installed at {path} (a checkout without the trained "
            "asset?); pass a checkpoint directory as MODEL"
        )
    return path


def model_or_default(model: str | None) -> str:
    """``model`` as given; the default bundled checkpoint's directory when it is None or empty; a bundled
    checkpoint's directory when ``model`` is one of ``BUNDLED_MODELS`` and no local path of that name exists
    (``mlaq validate mlaq-tiny-16k``)."""
    if not model:
        return str(bundled_model_dir())
    if model in BUNDLED_MODELS and not Path(model).exists():
        return str(bundled_model_dir(model))
    return model
