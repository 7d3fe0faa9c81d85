"""The ``--server`` options of ``mlaq validate``: measure a live deployment instead of the local engine.

``mlaq validate --server URL [--reference URL | --against FILE] [--record FILE] ...`` — the run's shape
(--eval-text, --windows, --context-len, --prompts, --tasks, ...: cli/validate_shape.py) and --out / --json
are shared with local validate.
"""

from __future__ import annotations

import argparse

from mlaq.cli import validate_shape

# local validate's options that mean nothing for a server (the server's own flags decide)
_LOCAL_ONLY = {
    "model": "MODEL",
    "schemes": "--schemes",
    "as_configured": "--as-configured",
    "quantization_config": "--quantization-config",
    "quantization": "--quantization",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("live server (validate a deployment: vLLM, SGLang, mlaq serve)")
    g.add_argument("--server", metavar="URL", help="the candidate server, e.g. http://127.0.0.1:8000")
    g.add_argument("--reference", metavar="URL", help="the reference server (e.g. the same model, flags off)")
    g.add_argument("--against", metavar="FILE", help="a reference recorded earlier with --record")
    g.add_argument(
        "--record", metavar="FILE", help="save --server's run as a reference (.safetensors or .json)"
    )
    g.add_argument(
        "--model", dest="served_model", metavar="NAME", help="served model name (default: the first)"
    )
    g.add_argument("--reference-model", metavar="NAME", help="served model name on --reference")
    g.add_argument("--api-key", metavar="KEY", help="Bearer key of the servers (vllm serve --api-key)")
    g.add_argument(
        "--reference-api-key", metavar="KEY", help="Bearer key of --reference (default: --api-key)"
    )
    g.add_argument("--tokenizer", metavar="PATH", help="local tokenizer (checkpoint dir or tokenizer.json)")
    g.add_argument(
        "--logprobs",
        type=int,
        default=20,
        metavar="K",
        help="top-k logprobs per position (default 20; -1: all)",
    )
    g.add_argument(
        "--mc-kl",
        type=int,
        default=0,
        metavar="N",
        help="also estimate KL without top-k truncation: N continuations sampled from --reference at "
        "temperature 1, scored on both servers (Monte-Carlo k1 / k3 with a bootstrap 95 %% interval)",
    )
    g.add_argument("--concurrency", type=int, default=4, metavar="N", help="requests in flight (default 4)")
    g.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        metavar="S",
        help="seconds a request may wait for its answer, not retried (default 180: a long prompt's first "
        "token; a 'still waiting' line every 30 s)",
    )
    g.add_argument(
        "--retries",
        type=int,
        default=3,
        metavar="N",
        help="retries of a refused or unreachable request (default 3)",
    )


def source_from_args(args: argparse.Namespace):  # -> ServerSource (lazily)
    """The live servers of ``--server`` as a measurement source."""
    from pathlib import Path

    from mlaq.validate.server import ClientConfig, ServerValidateConfig
    from mlaq.validate.server.record import check_record_path
    from mlaq.validate.sources.server import ServerSource

    for dest, flag in _LOCAL_ONLY.items():
        if getattr(args, dest, None) not in (None, False):
            raise ValueError(f"{flag} is for local validation; with --server the server's own flags decide")
    if getattr(args, "tensor_parallel_size", 1) != 1:
        raise ValueError(
            "--tensor-parallel-size is for local validation; with --server the server's own "
            "--tensor-parallel-size decides"
        )
    if args.reference_model and not args.reference:
        raise ValueError("--reference-model needs --reference URL")

    def client(url: str, key: str | None) -> ClientConfig:
        return ClientConfig(url, api_key=key, timeout=args.timeout, retries=args.retries)

    if args.record:  # before measuring: the suffix, and a file that is not a recording
        check_record_path(Path(args.record), args.overwrite)

    return ServerSource(
        ServerValidateConfig(
            server=client(args.server, args.api_key),
            reference=client(args.reference, args.reference_api_key or args.api_key)
            if args.reference
            else None,
            against=Path(args.against) if args.against else None,
            record=Path(args.record) if args.record else None,
            model=args.served_model,
            reference_model=args.reference_model,
            tokenizer=Path(args.tokenizer) if args.tokenizer else None,
            shape=validate_shape.run_shape(args, tasks=not args.against),  # a recording holds no task answers
            logprobs=args.logprobs,
            concurrency=args.concurrency,
            mc_kl=args.mc_kl,
        )
    )
