"""Real servers for the serving tests: launched few times, shared, checked idle after each test.

One tiny float64 model (context 512, with a chat template that shows tool names)
serves every test;
``server`` (radix cache, 4-token pages, 32-token prefill chunks) is launched
once per session. After each test that uses ``client``, the server must be
idle and pass the scheduler's idle-invariant check.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.client import Client
from tests.helpers.server import Server, wait_idle
from tests.helpers.tiny_models import make_tiny_model

CONTEXT = 512
SERVER_ARGS = ("--num-pages", "1024", "--page-size", "4", "--chunked-prefill-size", "32")
# Tool definitions, when given, as a line of their function names before the chat.
CHAT_TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}.\n"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="session")
def model_dir():
    folder = Path(tempfile.mkdtemp(prefix="rs-tiny-"))
    make_tiny_model(folder, "llama", seed=11, max_position_embeddings=CONTEXT)
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(tok_config))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def engine(model_dir):
    """The in-process oracle: the same model, run by the Engine."""
    return Engine(str(model_dir), dtype="float64", num_pages=2048)


@pytest.fixture(scope="session")
def server(model_dir):
    srv = Server(model_dir, *SERVER_ARGS)
    yield srv
    assert srv.stop() == 0, "SIGTERM must stop the server cleanly"
    assert srv.orphans() == []


@pytest.fixture
def client(server):
    with Client(server.endpoint, timeout=120) as c:
        yield c
        wait_idle(c)
        check = c.check()
        assert check == {"ok": True, "error": None}
