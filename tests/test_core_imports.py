"""The core must import with torch + numpy + safetensors alone; heavier packages are extras."""

import subprocess
import sys

from conftest import SRC

OPTIONAL = ("transformers", "tokenizers", "ml_dtypes", "rich", "matplotlib", "jinja2", "hypothesis", "pytest",
            "fastapi", "starlette", "uvicorn", "prometheus_client", "pydantic", "httpx", "openai")  # fmt: skip
EXTRA_PACKAGES = ("mlaq.serve",)  # the serve extra itself: needs FastAPI & co; nothing else imports it

SCRIPT = f"""
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {OPTIONAL!r}:
            raise ImportError('blocked optional dependency ' + name)
sys.meta_path.insert(0, Block())
import mlaq
failed = []
for m in pkgutil.walk_packages(mlaq.__path__, 'mlaq.'):
    if m.name.endswith('__main__') or m.name.startswith({EXTRA_PACKAGES!r}):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:
        failed.append(f'{{m.name}}: {{exc}}')
print('\\n'.join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_without_optional_dependencies():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env={"PYTHONPATH": str(SRC)}
    )
    assert out.returncode == 0, (
        f"modules needing an optional dependency at import time:\n{out.stdout}{out.stderr}"
    )
