"""The report renders from raw results: tables, ratios, targets and plots (synthetic runs)."""

from __future__ import annotations

import pytest

from bench.figures import RequestResult, summarize

pytest.importorskip("matplotlib")


def _run(server: str, conc: int, repeat: int, tps_scale: float, **extra) -> dict:
    reqs = [RequestResult(i, 0.0, 0.1 * (i + 1) / tps_scale, 2.0 / tps_scale, output_tokens=20)
            for i in range(4)]
    return {"phase": "sweep", "server": server, "concurrency": conc, "repeat": repeat,
            "figures": summarize(reqs, 2.0 / tps_scale),
            "memory": {"peak_rss": 2**30, "idle_rss": 2**29, "run_peak_rss": 2**29 + 2**20,
                       "run_growth": 2**20},
            "cpu": {"other_cores": 0.0}, "engine": None, "server_info": {"dtype": "float32"},
            "requests": [r.to_json() for r in reqs], **extra}


def _meta(**phase_seconds: float) -> dict:
    return {"command": "python -m bench.serving", "started": "t0", "finished": "t1",
            "machine": {"cpu": "cpu", "cores_available": 2, "logical_cpus": 2,
                        "memory_gib": 8, "load_avg_1m_at_start": 0.1},
            "versions": {"seqgate": "0.1.0", "seqgate_git_sha": "abc", "torch": "2",
                         "transformers": "5", "python": "3.11"},
            "model_dir": "/m", "weights_dtype": "float32",
            "args": {"max_tokens": 128, "seed": 0, "quick": False, "peer_arg": []},
            "phase_seconds": phase_seconds}


def test_report_renders_tables_ratios_and_targets(tmp_path):
    from bench.report import write_report

    sweep = [_run(s, c, rep, scale) for c in (1, 32) for rep in (0, 1)
             for s, scale in (("seqgate", 3.0), ("tf-serve-cb", 1.0))]
    data = {
        "meta": _meta(sweep=60.0),
        "sweep": sweep, "agreement": {}, "cache": [], "splitting": [], "failures": [],
    }
    doc = write_report(data, tmp_path / "benchmarks.md")
    text = doc.read_text()
    assert "| c=32 output tok/s vs tf-serve-cb | 3" in text
    assert "| tf-serve-cb | 32          | 3× (3–3)" in text
    assert (tmp_path / "benchmarks" / "throughput.png").stat().st_size > 0
    assert "![throughput vs concurrency](benchmarks/throughput.png)" in text


def test_a_seqgate_variant_is_compared_with_llamacpp(tmp_path):
    """`--servers seqgate,seqgate-int4,llama.cpp`: both seqgate rows get ratios against the peer,
    and the int4 row gets the c=1 target line of its own."""
    from bench.report import write_report

    sweep = [_run(s, 1, rep, scale) for rep in (0, 1)
             for s, scale in (("seqgate", 0.5), ("seqgate-int4", 0.8), ("llama.cpp", 1.0))]
    data = {"meta": _meta(sweep=60.0), "sweep": sweep, "agreement": {}, "cache": [],
            "splitting": [], "failures": []}
    text = write_report(data, tmp_path / "benchmarks.md").read_text()
    assert "| c=1 output tok/s vs llama.cpp                          | 0.5      | ≥ 0.7× | **no**" \
        in text
    assert "| c=1 output tok/s, seqgate --quantize int4 vs llama.cpp | 0.8      | ≥ 0.7× | yes" \
        in text
    assert "| seqgate-int4 | llama.cpp | 1           | 0.8× (0.8–0.8)" in text


def _split_run(config: str, splits: int, tps_scale: float, peak_kv: float, growth: int) -> dict:
    run = _run(f"seqgate {config}", 32, 0, tps_scale, config=config, max_splits=splits)
    run["phase"] = "splitting"
    run["memory"]["run_growth"] = growth
    hist = {"count": 10.0, "sum": 10.0 * splits, "mean": float(splits), "buckets": {},
            "max_le": float(splits)}
    run["engine"] = {"sub_batches_per_step": hist, "sparsity_per_step": hist,
                     "kv_gauges": {"seqgate_kv_cache_peak_bytes": peak_kv}}
    return run


def test_splitting_target_uses_the_engines_peak_kv(tmp_path):
    from bench.report import render

    defaults = "max_splits=3, max_sparsity=0.33 (defaults)"
    data = {
        "meta": {**_meta(splitting=60.0), "splitting_prompt_lengths": [10]},
        "sweep": [], "agreement": {}, "cache": [], "failures": [],
        # RSS growth says the opposite of the KV gauge: the target must follow the gauge.
        "splitting": [_split_run("max_splits=1", 1, 1.0, 400 * 2**20, 2**20),
                      _split_run(defaults, 3, 0.9, 100 * 2**20, 2**21)],
    }
    text = render(data, tmp_path / "benchmarks.md")
    assert "| splitting: defaults' peak KV / max_splits=1 | 0.25     | < 1×    | yes |" in text
    assert "| splitting: defaults' tok/s / max_splits=1   | 0.9      | ≥ 0.85× | yes |" in text
    assert "| max_splits=1 " in text and "| 400 " in text


def test_the_speculative_section_compares_with_the_faster_llamacpp(tmp_path):
    """Per workload and concurrency: acceptance and tokens per step from seqgate's engine
    counters, and the ratio taken against whichever llama.cpp was faster at that cell."""
    from bench.report import write_report

    def spec_run(server, workload, rep, scale, proposed=0, accepted=0):
        run = _run(server, 1, rep, scale, workload=workload, phase="speculative")
        if server.startswith("seqgate"):
            run["engine"] = {"spec_proposed_tokens": proposed, "spec_accepted_tokens": accepted,
                             "steps": 40, "generated_tokens": 80}
        return run

    runs = [spec_run(s, w, rep, scale, 100, 60 if w == "grounded" else 10)
            for rep in (0, 1) for w, lookup in (("sharegpt", 0.9), ("grounded", 1.6))
            for s, scale in (("seqgate", 1.2), ("seqgate-nospec", 1.0), ("llama.cpp", 1.0),
                             ("llama.cpp-lookup", lookup))]
    data = {"meta": _meta(speculative=60.0), "sweep": [], "agreement": {}, "cache": [],
            "splitting": [], "speculative": runs, "failures": []}
    data["meta"]["machine"]["isa"] = ["avx2", "fma"]
    text = write_report(data, tmp_path / "benchmarks.md").read_text()
    assert "CPU ISA: avx2 fma." in text
    row = next(line for line in text.splitlines()
               if line.startswith("| grounded | 1           | seqgate          |"))
    assert [c.strip() for c in row.split("|")[4:10]] == ["2", "48", "76.8", "0.208", "0.6", "2"]
    ratios = [[c.strip() for c in line.split("|")[1:6]] for line in text.splitlines()
              if line.startswith(("| grounded", "| sharegpt")) and "tok/s" not in line]
    assert ["grounded", "1", "seqgate", "llama.cpp-lookup", "0.75"] in ratios  # lookup faster
    assert ["sharegpt", "1", "seqgate", "llama.cpp", "1.2"] in ratios  # plain faster


def test_the_machines_speed_probes_are_reported_with_their_spread(tmp_path):
    """Each run's probes (bench/machine_speed.py, before and after it) become one line: the
    range of the fixed int8 product's time, and how far apart its ends are."""
    from bench.report import write_report

    def probes(before: float, after: float) -> dict:
        return {"before": {"int8_us": before, "bf16_us": 1.0, "stream_gbps": 12.0},
                "after": {"int8_us": after, "bf16_us": 1.0, "stream_gbps": 10.5}}

    sweep = [_run("seqgate", 32, 0, 1.0, machine_speed=probes(900.0, 910.0)),
             _run("llama.cpp", 32, 0, 1.0, machine_speed=probes(1550.0, 1575.0))]
    data = {"meta": _meta(sweep=60.0), "sweep": sweep, "agreement": {}, "cache": [],
            "splitting": [], "failures": []}
    text = write_report(data, tmp_path / "benchmarks.md").read_text()
    assert "a fixed int8 product took 900-1,575 µs (1.75× between" in text
    assert "memory streamed 10.5-12.0 GB/s" in text
    older = [_run("seqgate", 32, 0, 1.0)]  # results from before the probe: no line
    data["sweep"] = older
    assert "speed probe" not in write_report(data, tmp_path / "old.md").read_text()


def test_the_machine_speed_probe_times_its_three_kernels():
    import torch

    from bench.machine_speed import probe

    threads = torch.get_num_threads()
    speed = probe(threads=1, seconds=0.02)
    assert set(speed) == {"int8_us", "bf16_us", "stream_gbps"}
    assert all(v > 0 for v in speed.values())
    assert torch.get_num_threads() == threads


def test_a_capped_run_says_so_on_the_machine_line_and_beside_the_speculative_figures(
        tmp_path, monkeypatch):
    """`--cap-isa avx2` sets each library's cap in the environment the servers inherit, and
    the report names the cap wherever it names the ISA."""
    import os

    from bench import isa_cap
    from bench.report import write_report

    for name in isa_cap.CAPS["avx2"]:  # recorded, so the test's environment comes back
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    env = isa_cap.apply("avx2")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and os.environ["OV_CPU_MAX_ISA"] == "AVX2"
    assert os.environ["FBGEMM_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert isa_cap.apply(None) == {}
    with pytest.raises(ValueError, match="avx512"):
        isa_cap.apply("avx512")

    meta = _meta(sweep=60.0)
    meta["machine"]["isa"] = ["avx2", "avx512f", "avx512_bf16"]
    meta["isa_cap"] = {"isa": "avx2", "env": env}
    runs = [_run("seqgate", 1, 0, 1.0, workload="sharegpt", phase="speculative"),
            _run("llama.cpp", 1, 0, 1.0, workload="sharegpt", phase="speculative")]
    data = {"meta": meta, "sweep": [_run("seqgate", 32, 0, 1.0)], "agreement": {},
            "cache": [], "splitting": [], "speculative": runs, "failures": []}
    text = write_report(data, tmp_path / "benchmarks.md").read_text()
    machine = next(line for line in text.splitlines() if line.startswith("- Machine:"))
    assert "**capped to avx2**" in machine and "`OV_CPU_MAX_ISA=AVX2`" in machine
    assert "CPU ISA: avx2 avx512f avx512_bf16, capped to avx2." in text
    del data["meta"]["isa_cap"]
    assert "capped to" not in write_report(data, tmp_path / "plain.md").read_text()


def test_the_native_kernels_each_seqgate_server_ran_with_are_reported(tmp_path):
    """From the results' `/version`: one line naming each seqgate server's kernels, loud where a
    CPU server ran with none (an AVX512 host whose library failed to build did, unnoticed)."""
    from bench.report import write_report

    def info(attention: int, mode: str) -> dict:
        return {"dtype": "bfloat16", "device": "cpu", "engine": {"kernels": {
            "decode_attention_layers": attention, "w8a8": None, "native_layers": None,
            "linear": {"mode": mode, "max_rows": 4 if mode != "off" else 0}}}}

    sweep = [_run("seqgate", 1, 0, 1.0, server_info=info(30, "exact")),
             _run("seqgate-int4", 1, 0, 1.0, server_info=info(30, "int4")),
             _run("llama.cpp", 1, 0, 1.0)]
    data = {"meta": _meta(sweep=60.0), "sweep": sweep, "agreement": {}, "cache": [],
            "splitting": [], "failures": []}
    text = write_report(data, tmp_path / "benchmarks.md").read_text()
    assert ("seqgate: decode attention in 30 layers, linear blocks exact up to 4 rows" in text
            and "seqgate-int4: decode attention in 30 layers, linear blocks int4" in text)
    assert "without any native kernel" not in text
    sweep[0]["server_info"] = info(0, "off")
    text = write_report(data, tmp_path / "bare.md").read_text()
    assert "**seqgate ran without any native kernel**" in text  # and seqgate-int4 did not
    sweep[0]["server_info"] = {**info(0, "off"), "device": "cuda"}  # a GPU has none to run
    assert "without any native kernel" not in write_report(data, tmp_path / "gpu.md").read_text()
