import argparse
import logging

import pytest

from app.properties import PropertiesError, parse_properties, read_properties
from app.settings import SettingsError, add_arguments, load_settings

# The seed's serving.properties (seeds/001), with only the model id replaced.
SEED_PROPERTIES = """\
# serving.properties

engine=MPI
option.model_id=/models/SmolLM2-135M-Instruct.gguf
option.tensor_parallel_degree=1
option.dtype=fp16
option.trust_remote_code=true

# rolling-batch parameters
option.max_rolling_batch_size=64
option.rolling_batch=scheduler

# seq-scheduler parameters
option.max_sparsity=0.33
option.max_splits=3
option.decoding_strategy=contrastive  # other options: greedy, sample
"""


@pytest.fixture
def props(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "serving.properties"
        path.write_text(text)
        return str(path)

    return write


def test_seed_file_loads_unchanged(props):
    s = load_settings(config_file=props(SEED_PROPERTIES), env={})
    e = s.engine
    assert e.model_id == "/models/SmolLM2-135M-Instruct.gguf"
    assert (e.dtype, e.trust_remote_code, e.max_rolling_batch_size) == ("fp16", True, 64)
    assert (e.max_sparsity, e.max_splits, e.decoding_strategy) == (0.33, 3, "contrastive")


def test_trailing_comments_are_stripped_but_inner_hashes_kept():
    p = parse_properties("a=1  # one\nb = x#y\n! bang comment\nc: 3\n#d=4\n")
    assert {k: v.value for k, v in p.items()} == {"a": "1", "b": "x#y", "c": "3"}
    assert p["c"].line == 4


def test_unparsable_line_names_file_and_line():
    with pytest.raises(PropertiesError, match=r"f.properties:2"):
        parse_properties("a=1\njust words here\n", source="f.properties")


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(PropertiesError, match="cannot read"):
        read_properties(tmp_path / "nope.properties")


def test_precedence_flags_over_env_over_file_over_defaults(props):
    path = props("option.max_splits=2\noption.max_sparsity=0.5\njob_queue_size=7\n")
    env = {"SEQGATE_MAX_SPARSITY": "0.25", "SEQGATE_JOB_QUEUE_SIZE": "9"}
    s = load_settings({"job_queue_size": "11"}, env=env, config_file=path)
    assert s.engine.max_splits == 2  # file
    assert s.engine.max_sparsity == 0.25  # env over file
    assert s.engine.job_queue_size == 11  # flag over env
    assert s.engine.max_rolling_batch_size == 0 and s.engine.batch_rows == 64  # default: auto
    assert s.server.port == 8000


def test_config_path_from_env(props):
    path = props("option.max_splits=5\n")
    assert load_settings(env={"SEQGATE_CONFIG": path}).engine.max_splits == 5


def test_server_settings_from_env_and_flags():
    s = load_settings({"api_keys": ["k1", "k2"], "port": "9001"},
                      env={"SEQGATE_CORS_ORIGINS": "http://a.test, http://b.test",
                           "SEQGATE_HOST": "0.0.0.0", "SEQGATE_API_KEYS": "envkey"})
    assert s.server.api_keys == ("k1", "k2") and s.server.port == 9001
    assert s.server.cors_origins == ("http://a.test", "http://b.test")
    assert s.server.host == "0.0.0.0"


@pytest.mark.parametrize(("text", "key"), [
    ("option.max_sparsity=abc\n", "option.max_sparsity"),
    ("option.max_sparsity=1.5\n", "option.max_sparsity"),
    ("option.max_splits=0\n", "option.max_splits"),
    ("option.rolling_batch=vllm\n", "option.rolling_batch"),
    ("engine=TensorRT\n", "engine"),
    ("option.dtype=int8\n", "option.dtype"),
    ("option.decoding_strategy=beam\n", "option.decoding_strategy"),
    ("option.output_formatter=xml\n", "option.output_formatter"),
    ("option.trust_remote_code=maybe\n", "option.trust_remote_code"),
    ("option.tensor_parallel_degree=two\n", "option.tensor_parallel_degree"),
])
def test_bad_values_stop_startup_naming_the_key(props, text, key):
    with pytest.raises(SettingsError) as info:
        load_settings(config_file=props(text), env={})
    assert str(info.value).startswith(key)


def test_bad_env_and_flag_values_name_their_source():
    with pytest.raises(SettingsError, match="^SEQGATE_MAX_SPLITS="):
        load_settings(env={"SEQGATE_MAX_SPLITS": "many"})
    with pytest.raises(SettingsError, match="^--port="):
        load_settings({"port": "eighty"}, env={})
    with pytest.raises(SettingsError, match="--device"):
        load_settings({"device": "tpu"}, env={})  # rejected by EngineConfig itself


def test_unknown_keys_and_accepted_djl_keys_warn(props, caplog):
    path = props("option.made_up=1\noption.device_map=auto\noption.tensor_parallel_degree=max\n"
                 "option.rolling_batch=auto\nengine=Python\n")
    with caplog.at_level(logging.WARNING, logger="seqgate.settings"):
        load_settings(config_file=path, env={"SEQGATE_NOPE": "1"})
    text = caplog.text
    assert "option.made_up" in text and "option.device_map" in text
    assert "tensor_parallel_degree" in text and "SEQGATE_NOPE" in text


def test_dtype_aliases_and_model_dir(props):
    s = load_settings(config_file=props("option.dtype=bfloat16\noption.model_dir=/m\n"), env={})
    assert s.engine.dtype == "bf16" and s.engine.model_id == "/m"
    s = load_settings(config_file=props("option.model_id=/a\noption.model_dir=/b\n"), env={})
    assert s.engine.model_id == "/a"


def test_half_precision_without_a_gpu_is_a_log_line_not_a_crash(caplog):
    import torch

    from app.lifespan import _log_device_choice

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for dtype in ("fp16", "bf16"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="seqgate.app"):
            _log_device_choice(load_settings({"dtype": dtype}, env={}))
        assert f"option.dtype={dtype} but no GPU" in caplog.text


def test_quantize_from_each_source(props):
    assert load_settings(config_file=props("option.quantize=int4\n"), env={}).engine.quantize \
        == "int4"
    assert load_settings(env={"SEQGATE_QUANTIZE": "int8"}).engine.quantize == "int8"
    assert load_settings(env={}).engine.quantize == "none"
    with pytest.raises(SettingsError, match=r"^option.quantize .*int3.* one of none, int8, int4"):
        load_settings(config_file=props("option.quantize=int3\n"), env={})


def test_kv_cache_dtype_from_each_source(props):
    assert load_settings(env={}).engine.kv_cache_dtype == "auto"
    assert load_settings(config_file=props("option.kv_cache_dtype=float16\n"),
                         env={}).engine.kv_cache_dtype == "fp16"
    assert load_settings(env={"SEQGATE_KV_CACHE_DTYPE": "bf16"}).engine.kv_cache_dtype == "bf16"
    with pytest.raises(SettingsError, match=r"^option.kv_cache_dtype .*fp8.* one of auto, fp32"):
        load_settings(config_file=props("option.kv_cache_dtype=fp8\n"), env={})


def test_decode_attention_from_each_source(props):
    assert load_settings(env={}).engine.decode_attention == "auto"
    assert load_settings(config_file=props("option.decode_attention=sdpa\n"),
                         env={}).engine.decode_attention == "sdpa"
    assert load_settings(env={"SEQGATE_DECODE_ATTENTION": "sdpa"}).engine.decode_attention \
        == "sdpa"
    with pytest.raises(SettingsError, match=r"^option.decode_attention .*flash.* one of auto"):
        load_settings(config_file=props("option.decode_attention=flash\n"), env={})


def test_speculative_model_from_each_source(props):
    assert load_settings(env={}).engine.speculative_model is None
    for key in ("option.speculative_model", "option.speculative_draft_model"):
        assert load_settings(config_file=props(f"{key}=/models/draft\n"), env={}).engine \
            .speculative_model == "/models/draft"
    assert load_settings(env={"SEQGATE_SPECULATIVE_MODEL": "draft.gguf"}).engine \
        .speculative_model == "draft.gguf"
    assert load_settings({"speculative_model": "d"}, env={}).engine.speculative_model == "d"
    with pytest.raises(SettingsError, match="speculative_model"):
        load_settings(config_file=props("option.speculative_model=d\n"
                                        "option.tensor_parallel_degree=2\n"), env={})


def test_stall_ratio_from_each_source(props):
    assert load_settings(env={}).engine.stall_ratio == 2.5  # the default
    assert load_settings(config_file=props("option.stall_ratio=4\n"), env={}).engine \
        .stall_ratio == 4  # not the default, so the file is shown to be read
    assert load_settings(env={"SEQGATE_STALL_RATIO": "3"}).engine.stall_ratio == 3
    with pytest.raises(SettingsError, match=r"^option.stall_ratio .*> 1, or 0"):
        load_settings(config_file=props("option.stall_ratio=0.5\n"), env={})


def test_kv_budget_options_from_each_source(props):
    """kv_cache_bytes and gpu_memory_utilization, as serving.properties, SEQGATE_* and flags
    name them; EngineConfig alone says what is valid, reported under the name the user wrote."""
    default = load_settings(env={}).engine
    assert (default.kv_cache_bytes, default.gpu_memory_utilization) == (0, 0.9)
    path = props("option.kv_cache_bytes=1073741824\noption.gpu_memory_utilization=0.8\n")
    e = load_settings(config_file=path, env={}).engine
    assert (e.kv_cache_bytes, e.gpu_memory_utilization) == (2**30, 0.8)
    e = load_settings(env={"SEQGATE_KV_CACHE_BYTES": "5000",
                           "SEQGATE_GPU_MEMORY_UTILIZATION": "0.5"}).engine
    assert (e.kv_cache_bytes, e.gpu_memory_utilization) == (5000, 0.5)
    e = load_settings({"kv_cache_bytes": "7000", "gpu_memory_utilization": "0.95"},
                      env={"SEQGATE_KV_CACHE_BYTES": "5000"}).engine
    assert (e.kv_cache_bytes, e.gpu_memory_utilization) == (7000, 0.95)
    with pytest.raises(SettingsError, match=r"^option.gpu_memory_utilization .*1.5.* \(0, 1\]"):
        load_settings(config_file=props("option.gpu_memory_utilization=1.5\n"), env={})
    with pytest.raises(SettingsError, match=r"^SEQGATE_KV_CACHE_BYTES.*>= 0"):
        load_settings(env={"SEQGATE_KV_CACHE_BYTES": "-1"})
    with pytest.raises(SettingsError, match=r"^--kv-cache-bytes='lots' is invalid"):
        load_settings({"kv_cache_bytes": "lots"}, env={})


def test_kv_budget_flags_are_on_the_command_line():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-cache-bytes", "4096", "--gpu-memory-utilization", "0.7"])
    e = load_settings(args, env={}).engine
    assert (e.kv_cache_bytes, e.gpu_memory_utilization) == (4096, 0.7)


def test_cuda_graph_options_from_each_source(props):
    """enforce_eager and max_cudagraph_capture_size (vLLM's and DJL LMI's names) as
    serving.properties, SEQGATE_* and flags name them; a size below 1 is refused by name."""
    default = load_settings(env={}).engine
    assert (default.enforce_eager, default.max_cudagraph_capture_size) == (False, 512)
    e = load_settings(config_file=props("option.enforce_eager=true\n"
                                        "option.max_cudagraph_capture_size=256\n"), env={}).engine
    assert (e.enforce_eager, e.max_cudagraph_capture_size) == (True, 256)
    e = load_settings(env={"SEQGATE_ENFORCE_EAGER": "1",
                           "SEQGATE_MAX_CUDAGRAPH_CAPTURE_SIZE": "64"}).engine
    assert (e.enforce_eager, e.max_cudagraph_capture_size) == (True, 64)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    e = load_settings(parser.parse_args(["--enforce-eager", "--max-cudagraph-capture-size", "32"]),
                      env={}).engine
    assert (e.enforce_eager, e.max_cudagraph_capture_size) == (True, 32)
    with pytest.raises(SettingsError, match=r"^option.max_cudagraph_capture_size .*0"):
        load_settings(config_file=props("option.max_cudagraph_capture_size=0\n"), env={})
