"""A tiny checkpoint with a tokenizer and chat template, and a ``mlaq serve`` app running in a thread
on an ephemeral 127.0.0.1 port (the real uvicorn server, the real engine thread)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model_helpers import add_mtp_layer, edit_config, hf_checkpoint

CORPUS = ["the cat sat on the mat", "a dog ran in the park", "latent attention caches tokens"] * 10
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def chat_checkpoint(path: Path, mtp: bool = True) -> Path:
    """A random DeepSeek-V3 checkpoint (2 layers, MTP) with a BPE tokenizer.json and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model, _ = hf_checkpoint("deepseek_v3", path, num_hidden_layers=2)
    if mtp:
        add_mtp_layer(model, path)
    else:
        edit_config(path, num_nextn_predict_layers=0)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Metaspace()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", "<eos>"]))
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    return path


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    state: Any  # the ServerState (its .engine.engine is the LLMEngine)

    @property
    def v1(self) -> str:
        return self.url + "/v1"


@contextmanager
def serving(model: Path, engine: dict[str, Any] | None = None, **serve: Any) -> Iterator[Running]:
    """``mlaq serve MODEL`` in this process, on 127.0.0.1:<ephemeral>; stopped on exit."""
    import uvicorn

    from mlaq.serve.app import build_app
    from mlaq.serve.server import EngineArgs, bind, build_state

    state = build_state(EngineArgs(model=str(model), **(engine or {})), **serve)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(build_app(state), log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", state)
    finally:
        server.should_exit = True
        thread.join(30)


def scrape(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (model_name label dropped for brevity)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
        out[key] = float(value)
    return out
