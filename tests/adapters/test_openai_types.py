import subprocess
import sys
from pathlib import Path

import pytest

from adapters.errors import ApiError
from adapters.openai_types import ChatCompletionRequest, CompletionRequest, decode_request


def decode_error(body: bytes, type_=ChatCompletionRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_request(body, type_)
    assert info.value.status == 400
    return info.value


def test_nulls_mean_absent_and_unknown_fields_are_reported_not_rejected():
    body = (b'{"messages": [{"role": "user", "content": "hi", "name": null}], "logprobs": null,'
            b' "seed": null, "n": null, "frobnicate": 3, "stream_options": null}')
    req, unknown = decode_request(body, ChatCompletionRequest)
    assert req.logprobs is None and req.seed is None and req.n is None
    assert req.messages[0].content == "hi"
    assert unknown == ["frobnicate"]


def test_malformed_json_is_400_invalid_json():
    err = decode_error(b'{"messages": [')
    assert err.code == "invalid_json" and err.param is None
    assert decode_error(b"[1, 2]").code == "invalid_json"


def test_wrong_type_names_the_parameter():
    err = decode_error(b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}')
    assert err.param == "max_tokens" and err.code == "invalid_type"
    assert "max_tokens" in err.message


def test_nested_error_names_the_nested_parameter():
    err = decode_error(b'{"messages": [{"role": 5, "content": "x"}]}')
    assert err.param == "messages[0].role"


def test_missing_required_field():
    err = decode_error(b'{"model": "m"}')
    assert err.param == "messages" and err.code == "missing_required_parameter"
    err = decode_error(b'{"messages": [{"content": "x"}]}')
    assert err.param == "messages[0].role"


def test_completion_prompt_shapes_decode():
    for prompt in (b'"a"', b'["a", "b"]', b"[1, 2]", b"[[1], [2, 3]]"):
        req, _ = decode_request(b'{"prompt": ' + prompt + b"}", CompletionRequest)
        assert req.prompt


CONCURRENT_FIRST_USE = """
import sys, threading
sys.setswitchinterval(1e-6)
import msgspec
from typing import Literal, Optional, Union
from adapters.openai_types import convert

for k in range(200):
    ns = {"msgspec": msgspec, "Literal": Literal, "Optional": Optional, "Union": Union}
    exec(f'''
class Part{k}(msgspec.Struct, kw_only=True):
    role: Literal["user", "system"]
    content: Union[str, list[dict], None] = None
class Body{k}(msgspec.Struct, kw_only=True):
    messages: list[Part{k}]
    temperature: Optional[float] = None
    stop: Union[str, list[str], None] = None
''', ns)
    body_type = ns[f"Body{k}"]
    data = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
    barrier = threading.Barrier(4)
    def work():
        barrier.wait()
        for _ in range(3):
            convert(data, body_type)
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
print("ok")
"""


def test_first_conversions_from_several_threads_do_not_crash():
    """Request preparation runs on a thread pool. msgspec builds a type's conversion info on its
    first use, and threads doing that at once crashed the process (segmentation fault, every
    stream lost) until conversions were serialized; fresh types make every round a first use."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", CONCURRENT_FIRST_USE], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-500:])
