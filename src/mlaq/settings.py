"""mlaq's settings: the ONLY place mlaq reads the environment.

The variables are read once, into a frozen :class:`Settings`, and passed down explicitly; nothing
else in mlaq looks at ``os.environ``. Unlike vLLM's ``value.lower() in ("true", "1")`` (where a typo
silently means False), a value mlaq does not understand is an error.

>>> Settings.from_env({"MLAQ_FP4BMM": "on"})
Settings(fp8bmm=False, fp4bmm=True, platform=None, engine=<Engine.MLAQ: 'mlaq'>, vllm=None, sglang=None)

Two choices are not environment variables but travel with the settings, so every consumer of the
policy sees them: ``platform`` (the GPU a decision is for; None = mlaq's CPU emulation, where every
scheme exists) and ``engine`` (whose rules decide: mlaq's, or released vLLM 0.32's defaults, which
read vLLM's own ROCm variables into :class:`VllmRocmEnv`).

The vLLM plugin's variables (``MLAQ_VLLM_PLUGIN`` and the user's own VLLM_ROCM_USE_AITER* values, set
or not) are read here too, by :func:`VllmPluginEnv.from_env`.

One function writes the environment: :func:`bound_onednn_caches`, for torch's oneDNN (see there).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, TypeVar

TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off")
ACCEPTED = "1/0, true/false, yes/no, on/off (any case), or empty for the default"
# oneDNN's primitive cache and ideep's (per thread) cache of primitive descriptors, torch's CPU GEMMs in bf16
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_CAPACITY = 64  # GEMM shapes each keeps (torch's default: 1024)


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    """Parse one boolean variable; unset or empty (after stripping blanks) means ``default``."""
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v in TRUE_SPELLINGS:
        return True
    if v in FALSE_SPELLINGS:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; accepted values: {ACCEPTED}")


def bound_onednn_caches(
    environ: MutableMapping[str, str] | None = None, capacity: int = ONEDNN_CACHE_CAPACITY
) -> dict[str, str]:
    """Cap torch's two oneDNN caches at ``capacity`` GEMM shapes each, unless the variable is already set
    (the user's value wins); returns the values in effect. oneDNN and ideep read them once, at their first
    use, so this runs before the process's first bf16 GEMM (``mlaq``'s CLI and ``load_model`` call it).

    Where torch runs bf16 GEMMs through oneDNN (CPUs with AVX-512 BF16 or AMX), each new (M, K, N) adds a
    primitive descriptor to ideep's cache and a primitive to oneDNN's, ~0.55 MB together (measured at
    K = N = 256), up to 1,024 shapes each by default. Serving makes new shapes all the time: the MoE
    groups tokens by expert (an expert's row count follows the routing) and a prefill's rows follow the
    prompts' lengths, so the engine's RSS grew ~34 MB per 64 requests of the bundled model, towards
    ~550 MB. 64 shapes hold a decode step's GEMMs (8-10 distinct ones on the bundled model); a shape
    made again costs ~0.7 ms (oneDNN's misses over 3 rounds of 64 requests of 32 tokens: 191 at 64, 188
    at 1,024)."""
    env = os.environ if environ is None else environ
    for name in ONEDNN_CACHE_VARIABLES:
        if not env.get(name, "").strip():
            env[name] = str(capacity)
    return {name: env[name] for name in ONEDNN_CACHE_VARIABLES}


def kernel_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where mlaq builds its C kernel: ``$XDG_CACHE_HOME/mlaq/kernels``, by default
    ``~/.cache/mlaq/kernels`` (a relative XDG_CACHE_HOME is ignored, as the XDG spec says)."""
    env = os.environ if environ is None else environ
    home = env.get("XDG_CACHE_HOME", "")
    base = Path(home) if os.path.isabs(home) else Path(env.get("HOME") or Path.home()) / ".cache"
    return base / "mlaq" / "kernels"


def serve_api_key(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """``mlaq serve``'s API key: ``--api-key`` when given, else ``VLLM_API_KEY`` (vLLM's variable, which
    keeps the key out of ``ps``); None when neither is set. An empty or blank key is refused: it would
    turn authentication off without saying so."""
    env = os.environ if environ is None else environ
    key, source = (flag, "--api-key") if flag is not None else (env.get("VLLM_API_KEY"), "VLLM_API_KEY")
    if key is not None and not key.strip():
        raise ValueError(f"{source} is empty: give a non-empty key, or leave it unset to serve without one")
    return key


def _env_field(env: str, doc: str, default: bool = False) -> Any:
    return field(default=default, metadata={"env": env, "doc": doc})


class Platform(str, Enum):
    """Where a deployment runs (``--platform``): decides which AITER kernels and FP8 dtype exist."""

    ROCM_GFX942 = "rocm-gfx942"  # MI300X/MI325X: CDNA 3, e4m3fnuz, no MX
    ROCM_GFX950 = "rocm-gfx950"  # MI355X: CDNA 4, e4m3fn, MX
    CUDA = "cuda"
    CPU = "cpu"

    def __str__(self) -> str:
        return self.value


class Engine(str, Enum):
    """Whose rules decide (``--engine-defaults``): mlaq's policy, or released vLLM 0.32 / SGLang 0.5.23
    with their defaults."""

    MLAQ = "mlaq"
    VLLM_032 = "vllm-0.32"
    SGLANG_0523 = "sglang-0.5.23"

    def __str__(self) -> str:
        return self.value


_S = TypeVar("_S", bound="_EngineSwitches")


class _EngineSwitches:
    """An engine's boolean switches (dataclass fields made by ``_env_field``), read as the engine reads
    them: true/1 or false/0 (any case); any other spelling is refused with the class's ``REFUSAL``."""

    REFUSAL: ClassVar[str]

    @classmethod
    def from_env(cls: type[_S], env: Mapping[str, str]) -> _S:
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            name, raw = f.metadata["env"], env.get(f.metadata["env"])
            if raw is None:
                values[f.name] = f.default
            elif raw.lower() in ("true", "1", "false", "0"):
                values[f.name] = raw.lower() in ("true", "1")  # the engine's own test
            else:
                raise ValueError(f"{name}={raw!r}: {cls.REFUSAL}")
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        return {f.metadata["env"]: "1" if getattr(self, f.name) else "0" for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True)
class VllmRocmEnv(_EngineSwitches):
    """vLLM 0.32's ROCm switches for the MLA BMMs, with vLLM's defaults (vllm/envs.py): the master flag
    VLLM_ROCM_USE_AITER defaults to False, the two BMM flags to True. vLLM reads
    ``value.lower() in ("true", "1")``; mlaq refuses a spelling vLLM would silently read as False."""

    REFUSAL: ClassVar[str] = (
        "vLLM 0.32 reads anything but true/1 as False (vllm/envs.py); set 1/true or 0/false"
    )

    aiter: bool = _env_field("VLLM_ROCM_USE_AITER", "vLLM's AITER master switch (vLLM default 0)")
    fp8bmm: bool = _env_field("VLLM_ROCM_USE_AITER_FP8BMM", "AITER FP8 BMM for MLA (vLLM default 1)", True)
    fp4bmm: bool = _env_field("VLLM_ROCM_USE_AITER_FP4BMM", "AITER FP4 BMM for MLA (vLLM default 1)", True)


@dataclass(frozen=True)
class SglangEnv(_EngineSwitches):
    """SGLang 0.5.23's switches for the MLA BMMs, with SGLang's defaults: SGLANG_USE_AITER (False; read by
    ``get_bool_env_var`` in srt/models/deepseek_common/utils.py, which reads anything but true/1 as False)
    and SGLANG_USE_DEEPGEMM_BMM (False; srt/environ.py ``EnvBool``). mlaq refuses a spelling SGLang would
    read differently in its two parsers (``yes``: True for EnvBool, False for get_bool_env_var)."""

    REFUSAL: ClassVar[str] = (
        "SGLang 0.5.23 reads only true/1 and false/0 the same everywhere "
        "(srt/utils/common.py get_bool_env_var treats anything else as False); set 1/true or 0/false"
    )

    aiter: bool = _env_field("SGLANG_USE_AITER", "SGLang's AITER switch on ROCm (SGLang default 0)")
    deepgemm_bmm: bool = _env_field(
        "SGLANG_USE_DEEPGEMM_BMM", "DeepGEMM's block-FP8 BMM for MLA on Hopper (SGLang default 0)"
    )


@dataclass(frozen=True)
class Settings:
    """Run-time switches. Both BMM flags default OFF: accuracy over speed until opted in."""

    fp8bmm: bool = _env_field(
        "MLAQ_FP8BMM", "re-quantize unquantized kv_b_proj BMM weights to fp8_per_tensor online"
    )
    fp4bmm: bool = _env_field(
        "MLAQ_FP4BMM", "re-quantize bf16/fp16 kv_b_proj BMM weights to mxfp4 online (wins over FP8)"
    )

    platform: Platform | None = None  # None: mlaq's emulation (every scheme, on any CPU)
    engine: Engine = Engine.MLAQ
    vllm: VllmRocmEnv | None = None  # read only for engine vllm-0.32
    sglang: SglangEnv | None = None  # read only for engine sglang-0.5.23

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        platform: Platform | str | None = None,
        engine: Engine | str = Engine.MLAQ,
    ) -> Settings:
        """Read every variable from ``environ`` (default: ``os.environ``) once; vLLM's ROCm variables
        only when ``engine`` is vllm-0.32 (vLLM's) or sglang-0.5.23 (SGLang's, and vLLM's for the comparison)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            f.name: parse_bool(f.metadata["env"], env.get(f.metadata["env"]), f.default)
            for f in fields(cls)
            if "env" in f.metadata
        }
        engine = Engine(engine)
        vllm = VllmRocmEnv.from_env(env) if engine is not Engine.MLAQ else None
        sglang = SglangEnv.from_env(env) if engine is Engine.SGLANG_0523 else None
        plat = None if platform is None else Platform(platform)
        return cls(**values, platform=plat, engine=engine, vllm=vllm, sglang=sglang)

    @staticmethod
    def variable(attr: str) -> str:
        """The environment variable behind a field, e.g. ``variable("fp4bmm") == "MLAQ_FP4BMM"``."""
        for f in fields(Settings):
            if f.name == attr and "env" in f.metadata:
                return f.metadata["env"]
        raise KeyError(attr)

    def to_env(self) -> dict[str, str]:
        """``{"MLAQ_FP8BMM": "0", "MLAQ_FP4BMM": "1"}`` (plus vLLM's ROCm variables for engine vllm-0.32)."""
        env = {
            f.metadata["env"]: "1" if getattr(self, f.name) else "0"
            for f in fields(self)
            if "env" in f.metadata
        }
        if self.engine is Engine.SGLANG_0523 and self.sglang is not None:
            return {**env, **self.sglang.to_env()}
        return {**env, **(self.vllm.to_env() if self.vllm is not None else {})}

    def vllm_describe(self) -> str:
        """vLLM's ROCm variables as this decision reads them: ``VLLM_ROCM_USE_AITER=0 ...``."""
        return " ".join(f"{k}={v}" for k, v in (self.vllm or VllmRocmEnv()).to_env().items())

    def to_json(self) -> dict[str, Any]:
        """``{"MLAQ_FP8BMM": false, "MLAQ_FP4BMM": true}``; ``platform`` / ``engine`` (and vLLM's
        variables) only when they are not mlaq's defaults, so older reports read the same."""
        out: dict[str, Any] = {k: v == "1" for k, v in self.to_env().items()}
        if self.platform is not None:
            out["platform"] = self.platform.value
        if self.engine is not Engine.MLAQ:
            out["engine"] = self.engine.value
        return out

    def describe(self) -> str:
        """One line: ``MLAQ_FP8BMM=0 MLAQ_FP4BMM=1`` (then ``platform=...`` and ``engine=...`` when set)."""
        words = [f"{k}={v}" for k, v in self.to_env().items()]
        if self.platform is not None:
            words.append(f"platform={self.platform}")
        if self.engine is not Engine.MLAQ:
            words.append(f"engine={self.engine}")
        return " ".join(words)


def _explicit_vllm_bool(name: str, raw: str | None) -> bool | None:
    """A vLLM boolean variable as the user set it: None when unset or empty, refused when vLLM would
    silently read a typo as False."""
    if raw is None or not raw.strip():
        return None
    if raw.strip().lower() in ("true", "1", "false", "0"):
        return raw.strip().lower() in ("true", "1")
    raise ValueError(f"{name}={raw!r}: {VllmRocmEnv.REFUSAL}")


@dataclass(frozen=True)
class VllmPluginEnv:
    """What the vLLM plugin reads from the environment, once: its own JSON setting (for offline
    ``LLM(...)`` use; ``--additional-config '{"mlaq": ...}'`` wins) and the AITER BMM flags as the user
    set them (None: unset, where vLLM's own default True applies and mlaq's policy keeps bf16)."""

    config: str | None = None  # MLAQ_VLLM_PLUGIN: the plugin's JSON object, or None
    fp8bmm: bool | None = None  # VLLM_ROCM_USE_AITER_FP8BMM as set by the user
    fp4bmm: bool | None = None  # VLLM_ROCM_USE_AITER_FP4BMM as set by the user

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VllmPluginEnv:
        env = os.environ if environ is None else environ
        raw = env.get("MLAQ_VLLM_PLUGIN")
        return cls(
            None if raw is None or not raw.strip() else raw,
            _explicit_vllm_bool("VLLM_ROCM_USE_AITER_FP8BMM", env.get("VLLM_ROCM_USE_AITER_FP8BMM")),
            _explicit_vllm_bool("VLLM_ROCM_USE_AITER_FP4BMM", env.get("VLLM_ROCM_USE_AITER_FP4BMM")),
        )
