"""The benchmarks that have no other check, run here at small sizes: the GPU script (it runs on a
GPU only when one is lent, so CPU is where it is kept working), one scaling benchmark case and
the finished-rerun benchmark."""

import json

import numpy as np
import pytest

from benchmarks import (
    attention_variants,
    finished_rerun,
    gpu,
    op_profile,
    probe_overhead,
    reproduce_jobs,
    scaling,
    sweep_vs_sequential,
)


@pytest.mark.slow
def test_the_gpu_script_runs_its_cases_at_small_sizes(capsys):
    gpu.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    for case in ("matmul", "gpt2 L=2", "gpt2 L=3", "jena/noprobe", "jena full", "probe on"):
        assert case in out, case


@pytest.mark.parametrize("model", ["gpt2", "transformer"])
def test_a_scaling_case_is_one_run(model):
    """One run (β = 1) whatever the base config sweeps (configs/sst2.py:full sweeps 5 seeds)."""
    from resconv_jax.sweep import expand_runs

    (run,) = expand_runs(scaling.case_config(model, 256, 64))
    assert (run.beta_attn, run.beta_ffn) == (1.0, 1.0)


def test_a_scaling_case_reports_its_memory_and_time():
    record = scaling.run_case("transformer", 64, 16, 1, steps_per_call=3)
    assert record["P"] == 64 and record["microbatch"] == 16 and record["steps_per_call"] == 3
    assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0 and record["step_seconds"] > 0
    assert np.isfinite(record["loss"])  # the last of the call's 3 steps, not a NaN placeholder


def test_scaling_calls_chunks_of_the_library_default_log_every():
    from resconv_jax.config_defaults import base_config

    assert scaling.STEPS_PER_CALL == base_config().train.log_every


def test_the_scaling_report_fits_a_fixed_and_a_per_sample_cost():
    def case(num, seconds_per_round):
        measured = [
            {
                "model": "m",
                "P": num,
                "microbatch": 64,
                "temp_bytes": 2**20,
                "peak_rss_bytes": 2**30,
                "step_seconds": s,
            }
            for s in seconds_per_round
        ]
        return scaling.best_of(measured)

    # 10 ms + 100 µs per sample, one round slowed by a load: the fastest round counts.
    records = [case(p, (0.01 + 1e-4 * p, 0.03 + 1e-4 * p)) for p in (256, 1024, 4096)]
    text = "\n".join(scaling.report(records, "m", 64))
    assert "step time = 10.0 ms + 100.0 µs·P (the fixed part is 28 % of the P = 256 step)" in text
    assert "time per sample within 19 % of the mean (target ±15 %): NOT met" in text
    assert "the fastest of 2 rounds" in text


@pytest.mark.slow
def test_the_hugging_face_comparison_checks_agreement_and_times_at_a_small_size(capsys):
    """benchmarks/vs_hf_gpt2.py end to end where requirements-bench.txt is installed (torch and
    transformers are not in the dev install: skipped there). It stopped in its agreement check
    from 974d2d4 to 1d02bb1 unnoticed."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks import vs_hf_gpt2

    vs_hf_gpt2.main(["--layers", "1", "--batch", "4", "--tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "L=1: loss at start JAX" in out and "of matmul" in out
    assert "| 1 | 3 " in out, out  # L = 1, timed as trained: 3 steps per run_steps call


@pytest.mark.slow
@pytest.mark.parametrize(
    "main, argv, expected",
    [
        (
            attention_variants.main,
            ["--repeats", "1", "--runs", "1"],
            ["library", "transposed", "keys_major", "the same bits from the library"],
        ),
        (probe_overhead.main, ["--sizes", "theory", "--repeats", "1"], ["| theory |"]),
        (
            sweep_vs_sequential.main,
            ["--part", "steps", "--sizes", "theory", "--repeats", "1"],
            ["check: plain R=5: losses after", "| library"],
        ),
        (
            op_profile.main,
            ["--P", "16", "--steps", "2", "--calls", "1", "--top", "500"],
            ["untraced step", "dot of (f32[16,24,24], f32[16,24,6])"],
        ),
        (
            op_profile.main,
            ["--scaling", "transformer", "--P", "128", "--calls", "1", "--top", "500"],
            ["scaling case transformer, P=128, microbatches of 64", "dot of"],
        ),
    ],
    ids=[
        "attention_variants",
        "probe_overhead",
        "sweep_vs_sequential",
        "op_profile",
        "op_profile_scaling",
    ],
)
def test_an_in_process_benchmark_runs_at_its_smallest(main, argv, expected, capsys):
    """Each benchmark that needs no torch, at one repeat: it runs, checks its agreement and prints
    its table (benchmarks/vs_hf_gpt2.py once stopped in its check for weeks unnoticed)."""
    main(argv)
    out = capsys.readouterr().out
    for text in expected:
        assert text in out, (text, out[-2000:])


@pytest.mark.slow
def test_the_finished_rerun_benchmark_times_its_three_commands(tmp_path, capsys):
    finished_rerun.main(["--config=configs/tiny.py", "--repeats=1", f"--workdir={tmp_path / 'w'}"])
    out = capsys.readouterr().out
    for case in ("| rerun ", "| rerun, redraw ", "| import jax "):
        assert case in out, out
    assert (tmp_path / "w" / finished_rerun.CACHE_FILE).exists()


def test_the_reproduce_jobs_benchmark_refuses_other_bytes():
    same = {"a/metrics.jsonl": b"1", "b.csv": b"2"}
    assert reproduce_jobs.differing(same, dict(same)) == []
    assert reproduce_jobs.differing(same, same | {"b.csv": b"3"}) == ["b.csv"]
    assert reproduce_jobs.differing(same, {"b.csv": b"2"}) == ["a/metrics.jsonl"]


def test_the_reproduce_jobs_benchmark_times_only_the_same_bytes(monkeypatch, capsys):
    """The benchmark's bookkeeping, with `reproduce` replaced by a writer of one metrics file
    (`tests/test_reproduce_jobs.py` runs the real workers): a ratio of the two cases' times, and
    no time at all when --jobs wrote other bytes."""
    walls = {1: 6.0, 2: 4.0}
    content = {1: b"same", 2: b"same"}

    def fake_reproduce(workdir, scale, only, jobs, cache=None):
        (workdir / "a").mkdir(parents=True)
        (workdir / "a" / "metrics.jsonl").write_bytes(content[jobs])
        times = {"a": {"scale": scale, "seconds": 3.0}, "b": {"scale": scale, "seconds": 5.0}}
        (workdir / "reproduce.json").write_text(json.dumps(times))
        return walls[jobs]

    monkeypatch.setattr(reproduce_jobs, "run_reproduce", fake_reproduce)
    reproduce_jobs.main(["--scale=tiny", "--repeats=2"])
    out = capsys.readouterr().out
    assert "1 files, the same bytes" in out and "| --jobs=2                 | 4.0 s" in out, out
    assert "1.50x" in out and "--jobs=2: 4.0 s; experiments (s): b 5, a 3" in out
    # --warm: a third command, on the --jobs command's cache, held to the same bytes.
    caches = []
    monkeypatch.setattr(
        reproduce_jobs,
        "run_reproduce",
        lambda *args, cache=None: caches.append(cache) or fake_reproduce(*args),
    )
    reproduce_jobs.main(["--scale=tiny", "--warm"])
    out = capsys.readouterr().out
    assert caches[:2] == [None, None] and caches[2].name.startswith("jobs2_0_cache"), caches
    assert "| --jobs=2, compilation cache filled | 4.0 s" in out, out
    content[2] = b"other"
    with pytest.raises(SystemExit, match=r"other bytes than one at a time: \['a/metrics.jsonl'\]"):
        reproduce_jobs.main(["--scale=tiny"])
    assert "speedup" not in capsys.readouterr().out
