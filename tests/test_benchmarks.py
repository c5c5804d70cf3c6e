"""The benchmarks that have no other check, run here at small sizes: the GPU script (it runs on a
GPU only when one is lent, so CPU is where it is kept working), one scaling benchmark case and
the finished-rerun benchmark."""

import pytest

from benchmarks import finished_rerun, gpu, scaling


@pytest.mark.slow
def test_the_gpu_script_runs_its_cases_at_small_sizes(capsys):
    gpu.main(["--quick", "--repeats", "1"])
    out = capsys.readouterr().out
    for case in ("matmul", "gpt2 L=2", "gpt2 L=3", "jena/noprobe", "jena full", "probe on"):
        assert case in out, case


def test_a_scaling_case_reports_its_memory_and_time():
    record = scaling.run_case("transformer", 64, 16, 1)
    assert record["P"] == 64 and record["microbatch"] == 16
    assert record["temp_bytes"] > 0 and record["peak_rss_bytes"] > 0 and record["step_seconds"] > 0


@pytest.mark.slow
def test_the_finished_rerun_benchmark_times_its_three_commands(tmp_path, capsys):
    finished_rerun.main(["--config=configs/tiny.py", "--repeats=1", f"--workdir={tmp_path / 'w'}"])
    out = capsys.readouterr().out
    for case in ("| rerun ", "| rerun, redraw ", "| import jax "):
        assert case in out, out
    assert (tmp_path / "w" / finished_rerun.CACHE_FILE).exists()
