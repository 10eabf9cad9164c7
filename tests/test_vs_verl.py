"""benchmarks/vs_verl.py without a GPU (issue 59): both command lines carry the same kernel, CUDA-graph, memory and
sampling settings, verl gets its defaults wherever the table does not give a reason, the runs take turns (ABBA), and
the record's medians and ratios are the hand-computed ones."""
import importlib.util
import json
import os
import sys

import pytest

from verl_release import LATEST, verl_release

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vs_verl():
    sys.path.insert(0, REPO)
    spec = importlib.util.spec_from_file_location("vs_verl", os.path.join(REPO, "benchmarks", "vs_verl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_args(vs_verl, *extra):
    return vs_verl.parse_args(["--data-dir", "/data", "--tokenizer", "/tok", "--work-dir", "/tmp/vs_verl_test",
                               "--out-dir", "/tmp/vs_verl_test/out", *extra])


def argv_values(run) -> dict[str, str]:
    return dict(entry.split("=", 1) for entry in run["argv"][3:])


def test_both_commands_carry_the_same_kernels_graphs_memory_and_sampling(vs_verl):
    runs = vs_verl.plan(make_args(vs_verl), "/model")
    ours, verl = (argv_values(next(run for run in runs if run["trainer"] == name)) for name in ("hybridrl", "verl"))
    sglang = "+actor_rollout_ref.rollout.engine_kwargs.sglang"
    same = {"actor_rollout_ref.model.use_fused_kernels": "true", "actor_rollout_ref.model.use_remove_padding": "true",
            f"{sglang}.cuda_graph_max_bs_decode": "512",  # 64 prompts x 8 samples on one engine
            f"{sglang}.attention_backend": "triton", f"{sglang}.sampling_backend": "pytorch",
            "actor_rollout_ref.rollout.gpu_memory_utilization": "0.5", "actor_rollout_ref.rollout.max_num_seqs": "1024",
            "actor_rollout_ref.rollout.enforce_eager": "false", "actor_rollout_ref.rollout.temperature": "1.0",
            "actor_rollout_ref.rollout.top_p": "1.0", "actor_rollout_ref.rollout.top_k": "-1",
            "actor_rollout_ref.rollout.n": "8", "data.train_batch_size": "64"}
    for key, value in same.items():
        assert (ours[key], verl[key]) == (value, value), key
    # what hybridrl derives for SGLang itself, verl gets as engine arguments: prefill chunk and 256 + 512 + 2 context
    assert ours["actor_rollout_ref.rollout.max_num_batched_tokens"] == verl[f"{sglang}.chunked_prefill_size"] == "8192"
    assert verl[f"{sglang}.context_length"] == "770"
    # the same attention kernel: hybridrl's varlen, registered in verl's processes through verl's external_lib hook
    assert verl["+actor_rollout_ref.model.override_config.attn_implementation"] == "hybridrl_varlen"
    assert verl["actor_rollout_ref.model.external_lib"] == "benchmarks.vs_verl_attention"
    # verl keeps its default use_torch_compile (the fused path never calls the compiled entropy)
    assert not [key for key in list(ours) + list(verl) if "use_torch_compile" in key]
    assert verl["reward.custom_reward_function.path"] == ours["custom_reward_function.path"]


def test_graph_size_follows_the_sequences_per_engine_and_padded_rows_use_sdpa(vs_verl):
    runs = vs_verl.plan(make_args(vs_verl, "--gpus", "2", "--padded", "--prompts", "40"), "/model")
    for run in runs:
        values = argv_values(run)
        # 40 x 8 = 320 sequences over 2 engines: 160, a size SGLang captures (steps of 8 up to 256)
        assert values["+actor_rollout_ref.rollout.engine_kwargs.sglang.cuda_graph_max_bs_decode"] == "160"
        assert values["actor_rollout_ref.model.use_remove_padding"] == "false"
    verl = argv_values(next(run for run in runs if run["trainer"] == "verl"))
    assert verl["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    assert "actor_rollout_ref.model.external_lib" not in verl


def test_runs_take_turns_each_in_its_own_directory(vs_verl):
    abba = vs_verl.plan(make_args(vs_verl), "/model")
    assert [run["trainer"] for run in abba] == ["hybridrl", "verl", "verl", "hybridrl"]
    assert len({run["run_dir"] for run in abba}) == 4
    assert [run["trainer"] for run in vs_verl.plan(make_args(vs_verl, "--order", "BAAB"), "/m")] == [
        "verl", "hybridrl", "hybridrl", "verl"]
    verl_env = abba[1]["env"]
    assert verl_env["PYTHONPATH"].split(":")[:2] == [vs_verl.VERL_TF_SITE, vs_verl.VERL_SITE]  # its pinned transformers
    assert verl_env["VERL_FILE_LOGGER_PATH"].startswith(abba[1]["run_dir"])
    assert vs_verl.VERL_SITE not in abba[0]["env"]["PYTHONPATH"].split(":")
    with pytest.raises(SystemExit, match="--order: expected letters A"):
        vs_verl.run_order("ABCA")


def test_merged_turns_run_as_one_process_of_both_turns_steady_steps(vs_verl):
    merged = vs_verl.plan(make_args(vs_verl, "--merge-turns", "--steps", "6", "--warmup-steps", "1"), "/model")
    assert [(run["trainer"], run["turns"]) for run in merged] == [("hybridrl", 1), ("verl", 2), ("hybridrl", 1)]
    # one warm-up step, then 5 steady steps for each turn: 6 and 1 + 2 x 5 = 11
    assert [argv_values(run)["trainer.total_training_steps"] for run in merged] == ["6", "11", "6"]
    assert vs_verl.processes("ABBAAB", merge_turns=True) == [("hybridrl", 1), ("verl", 2), ("hybridrl", 2),
                                                             ("verl", 1)]
    assert vs_verl.processes("ABBA", merge_turns=False) == [("hybridrl", 1), ("verl", 1), ("verl", 1), ("hybridrl", 1)]


def test_bad_arguments_are_refused(vs_verl, capsys):
    with pytest.raises(SystemExit):
        make_args(vs_verl, "--steps", "3", "--warmup-steps", "3")
    assert "--warmup-steps: expected 0 <= it < --steps (3), got 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vs_verl.parse_args(["--shape", "0.5b"])
    assert "--out-dir: expected a directory" in capsys.readouterr().err


def test_every_departure_from_a_default_has_a_reason(vs_verl):
    args = make_args(vs_verl)
    rows = vs_verl.table.settings(args, "/model", "/run")
    verl_defaults = vs_verl.table.default_config("verl", str(verl_release(LATEST)))
    tables = {"hybridrl": vs_verl.table.override_table(rows, "hybridrl", vs_verl.table.default_config("hybridrl", "")),
              "verl": vs_verl.table.override_table(rows, "verl", verl_defaults)}
    for trainer, entries in tables.items():
        assert all(entry["reason"] for entry in entries if entry["departs"]), trainer
    verl = {entry["key"]: entry for entry in tables["verl"]}
    # verl 0.9.1's defaults, read from its generated ppo_trainer.yaml
    assert verl["actor_rollout_ref.model.use_fused_kernels"]["default"] is False
    assert verl["actor_rollout_ref.model.use_fused_kernels"]["departs"] is True
    assert verl["actor_rollout_ref.rollout.max_num_seqs"]["default"] == 256
    assert verl["actor_rollout_ref.rollout.max_num_batched_tokens"]["departs"] is False
    assert verl["+actor_rollout_ref.rollout.engine_kwargs.sglang.cuda_graph_max_bs_decode"]["default"] is None
    ours = {entry["key"]: entry for entry in tables["hybridrl"]}
    assert ours["actor_rollout_ref.rollout.update_weights_bucket_megabytes"] == {
        "key": "actor_rollout_ref.rollout.update_weights_bucket_megabytes", "value": 2048, "default": 512,
        "departs": True, "reason": "verl's default, given to both"}


def test_hybridrl_side_validates(vs_verl, capsys):
    run = vs_verl.plan(make_args(vs_verl), "/model")[0]
    vs_verl.check_hybridrl_overrides(run["argv"])
    assert "composes and validates" in capsys.readouterr().out


def steps(times: list[float], peak: float) -> list[dict]:
    return [{"timing_s/step": t, "timing_s/gen": t / 2, "perf/max_memory_allocated_gb": peak + k}
            for k, t in enumerate(times)]


def test_medians_and_ratios_of_step_time_least_flattering_first(vs_verl):
    runs = [{"index": 1, "trainer": "hybridrl", "steps": steps([30, 10, 12, 11, 13, 14], 40)},
            {"index": 2, "trainer": "verl", "steps": steps([100, 20, 22, 21, 23, 24], 50)},
            {"index": 3, "trainer": "verl", "steps": steps([90, 18, 19, 20, 21, 22], 50)},
            {"index": 4, "trainer": "hybridrl", "steps": steps([25, 9, 10, 11, 12, 13], 40)}]
    for run in runs:
        run.update(vs_verl.steady_summary(run["steps"], warmup=1))
    assert runs[0]["median_s"] == {"generate": 6.0, "step": 12}  # steady steps 10, 12, 11, 13, 14
    assert runs[0]["steady_steps"] == 5 and runs[0]["peak_memory_gb"] == 45  # 40 + 5: the peak over every step
    summary = vs_verl.summarize(runs, warmup=1, per_turn=5)
    assert summary["trainers"]["hybridrl"]["median_s"]["step"] == 11.5  # of 10 12 11 13 14 9 10 11 12 13
    assert summary["trainers"]["verl"]["median_s"]["step"] == 21  # of 20 22 21 23 24 18 19 20 21 22
    assert summary["phase_ratios_pooled"]["generate"] == pytest.approx(5.75 / 10.5)
    got = [(round(entry["ratio"], 4), entry["what"].split(":")[0]) for entry in summary["step_time_ratios"]]
    assert got == [(round(12 / 20, 4), "bound"), (round(11 / 20, 4), "pair 2"), (round(11.5 / 21, 4), "pooled"),
                   (round(12 / 22, 4), "pair 1")]


def test_a_merged_run_is_paired_turn_by_turn(vs_verl):
    """A, BB, A (--merge-turns): verl's one process holds two turns of 3 steady steps; each is paired with its
    neighbour, and the bound takes verl's fastest turn, not its whole run."""
    runs = [{"index": 1, "trainer": "hybridrl", "steps": steps([30, 10, 11, 12], 40)},
            {"index": 2, "trainer": "verl", "turns": 2, "steps": steps([100, 18, 19, 20, 22, 23, 24], 50)},
            {"index": 3, "trainer": "hybridrl", "steps": steps([25, 13, 14, 15], 40)}]
    got = [(round(entry["ratio"], 4), entry["what"]) for entry in vs_verl.summarize(runs, 1, 3)["step_time_ratios"]]
    assert got == [(round(14 / 19, 4), "bound: hybridrl's slowest turn / verl's fastest turn"),
                   (round(14 / 23, 4), "pair 2: run 3 (hybridrl) / run 2 turn 2 (verl)"),
                   (round(12.5 / 21, 4), "pooled: all steady steps of each trainer"),
                   (round(11 / 19, 4), "pair 1: run 1 (hybridrl) / run 2 turn 1 (verl)")]


def test_a_run_is_read_summarised_and_its_log_kept(vs_verl, tmp_path):
    """One real subprocess in the role of a trainer: it logs three steps the way verl's file logger does."""
    metrics = tmp_path / "run" / "verl_metrics.jsonl"
    lines = [json.dumps({"step": k, "data": {"timing_s/step": 10.0 + k, "actor/perf/max_memory_allocated_gb": 5.0}})
             for k in (1, 2, 3)]
    code = (f"import pathlib; print('sglang: cuda graph bs 512'); print('\\x1b[36m(SGLangHttpServer pid=7)\\x1b[0m '); "
            f"print('\\x1b[36m(SGLangHttpServer pid=7)\\x1b[0m Capturing batches (bs=512 avail_mem=36.51 GB)'); "
            f"pathlib.Path({str(metrics)!r}).write_text({chr(10).join(lines)!r})")
    spec = {"index": 2, "trainer": "verl", "run_dir": str(tmp_path / "run"), "metrics": str(metrics),
            "argv": [sys.executable, "-c", code], "env": {}}
    out = tmp_path / "out"
    out.mkdir()
    result = vs_verl.run_one(spec, timeout=60, warmup=1, out_dir=str(out))
    assert result["exit"] == 0 and result["error"] is None
    assert [step["timing_s/step"] for step in result["steps"]] == [11.0, 12.0, 13.0]
    assert result["median_s"] == {"step": 12.5} and result["peak_memory_gb"] == 5.0  # verl's memory name read
    # Ray's prefix names the SGLang server on every line it prints: a line is kept by its own text, blank ones not
    assert result["engine_log_lines"] == ["sglang: cuda graph bs 512", "Capturing batches (bs=512 avail_mem=36.51 GB)"]
    with open(result["log"]) as log:  # the whole log copied, Ray's prefixes and blank lines too
        assert (out / "2_verl.log").read_text() == log.read() and log.name.endswith("2_verl.log")
