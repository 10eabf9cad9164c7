"""The embedded default: data, tiny model and warm start that `python -m hybridrl.main_ppo` uses out of the box.

Three stages, each a directory under the cache dir (`$HYBRIDRL_CACHE_DIR`, else ~/.cache/hybridrl):

    data/default/          train.parquet, test.parquet (RL prompts, verl's layout) and
                           sft_train.parquet, sft_test.parquet (the same questions as chat with an answer)
    models/default_init/   a tokenizer trained on that text and a randomly initialised tiny Qwen2
    models/default_sft/    default_init after a short SFT (hybridrl.trainer.main_sft on 2 ranks)

Each stage is built in a temporary sibling directory, a marker file holding its recipe is written
last, and only then is it renamed into place. So a directory at a stage's path is either complete
(it has the marker) or was damaged afterwards. On every run each stage is checked (marker present
and naming the same recipe, files present, safetensors not truncated) and reused when it passes;
otherwise a `[hybridrl]` line says what is wrong and it is rebuilt, together with every later stage.

The task: reasoning-gym `decimal_chain_sum` with 0 decimal places, i.e. "a + b - c" of one-digit
integers. It is chosen over `chain_sum` (same questions) for its verifier: exact match scores 1,
anything else 0, whereas chain_sum's pays partial credit when the right answer is a substring of the
given one, which GRPO learns to exploit by answering digit strings like "1110".

The warm-start data answers one question in five in the graded format (`<answer>N</answer>`) and the
other four as "The answer is N." (no tags: reward 0). This stands for a model that has learned the
arithmetic but rarely uses the grader's format, as a base model meeting a new answer format. The
format is chosen at the first answer token and the data gives no reason to prefer it for any
question, so after SFT the tag's first token has probability about 0.2 on every question (0.19 to
0.21 measured). Greedy decoding then never picks the graded format: the validation score starts at 0,
while sampling (temperature 1) still writes it one time in five, enough for GRPO's groups of 8 to
find rewarded answers, and RL learns the format from the reward. With the default GRPO settings (30
steps of 16 prompts x 8 samples, actor lr 1e-4) greedy accuracy went from 0% to 55-76% for seeds 1-3,
on 2 CPU ranks, on 1, and on 1 with the GPU path's bf16 forced on the CPU; from step 20 on every greedy
answer was tagged, so the score is then the tiny model's arithmetic in that format (70% when the SFT
model's answer is forced to start with the tag).

Why a clear minority and not half. With half the answers tagged, the first token's two choices end
up within a few thousandths of each other, and greedy decoding follows whichever wins by rounding:
the same SFT model scored 20% greedy in fp32 and 72% cast to bf16 (the GPU path's precision), so the
run's start, and with it RL's visible gain, depended on the device. At 0.2 against 0.8 the greedy
choice is the same in both precisions, on 1 or 2 SFT ranks. Without any format gap (all answers
tagged, SFT stopped early at 13% accuracy), GRPO improved the arithmetic itself by only about 10
points in 150 steps of 64 x 8 samples: too slow for a 10-minute CPU demo.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow.parquet as pq

from hybridrl.utils.safetensors_header import count_elements, safetensors_problem

MARKER_FILE = ".hybridrl_prepared.json"
SFT_METRICS_FILE = "sft_metrics.jsonl"


@dataclass
class DefaultRecipe:
    """Every knob of the embedded default; the markers record it, so a changed knob rebuilds what it affects."""
    task: str = "decimal_chain_sum"
    task_config: dict = field(default_factory=lambda: {
        "min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1,
        "min_decimal_places": 0, "max_decimal_places": 0})
    train_size: int = 2000
    test_size: int = 400          # before dropping the test questions that also occur in train
    seed: int = 0
    tagged_fraction: float = 0.2  # share of warm-start answers in the graded <answer></answer> format (docstring: why)
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    model_seed: int = 0
    # main_sft overrides ("key": value) on top of hybridrl/config/sft_trainer.yaml, e.g. fewer steps in tests.
    sft_overrides: dict = field(default_factory=dict)


@dataclass
class DefaultPaths:
    data_dir: str
    train_file: str
    val_file: str
    sft_train_file: str
    sft_val_file: str
    init_model_dir: str
    sft_model_dir: str


def default_paths(cache_dir: str) -> DefaultPaths:
    """Where each piece of the embedded default lives under `cache_dir` (the config's `cache_dir`)."""
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    data_dir = os.path.join(cache_dir, "data", "default")
    return DefaultPaths(
        data_dir=data_dir,
        train_file=os.path.join(data_dir, "train.parquet"), val_file=os.path.join(data_dir, "test.parquet"),
        sft_train_file=os.path.join(data_dir, "sft_train.parquet"),
        sft_val_file=os.path.join(data_dir, "sft_test.parquet"),
        init_model_dir=os.path.join(cache_dir, "models", "default_init"),
        sft_model_dir=os.path.join(cache_dir, "models", "default_sft"))


def ensure_default_assets(config) -> None:
    """Prepare the embedded default when the PPO config uses its paths (a user's own model or data is left alone)."""
    paths = default_paths(config.cache_dir)
    model_paths = [config.actor_rollout_ref.model.path] + ([config.critic.model.path] if config.critic.enable else [])
    uses_model = any(_same_path(path, paths.sft_model_dir) for path in model_paths)
    uses_data = any(_same_path(path, default) for path in config.data.train_files + config.data.val_files
                    for default in (paths.train_file, paths.val_file))
    if uses_model or uses_data:
        prepare_default_assets(config.cache_dir, with_model=uses_model)


def prepare_default_assets(cache_dir: str, recipe: DefaultRecipe | None = None, with_model: bool = True) -> DefaultPaths:
    """Build whatever is missing, damaged or of another recipe; reuse the rest. Returns the paths."""
    recipe = recipe or DefaultRecipe()
    paths = default_paths(cache_dir)
    recipe_fields = dataclasses.asdict(recipe)
    data_recipe = {key: recipe_fields[key] for key in
                   ("task", "task_config", "train_size", "test_size", "seed", "tagged_fraction")}
    rebuilt = build_stage("data", paths.data_dir, data_recipe, _data_problem,
                     lambda out_dir: _build_data(out_dir, recipe), upstream_rebuilt=False)
    if not with_model:
        return paths
    model_recipe = {key: recipe_fields[key] for key in recipe_fields if key != "sft_overrides"}
    rebuilt = build_stage("tiny model", paths.init_model_dir, model_recipe, model_dir_problem,
                     lambda out_dir: _build_init_model(out_dir, paths, recipe), upstream_rebuilt=rebuilt)
    sft_config = _sft_config(paths, recipe)
    build_stage("SFT warm start", paths.sft_model_dir, {**recipe_fields, "sft_settings": _sft_settings(sft_config)},
           model_dir_problem, lambda out_dir: _build_sft_model(out_dir, sft_config), upstream_rebuilt=rebuilt)
    return paths


# ---- the stage mechanics: check, build aside, mark, rename ----

def build_stage(name: str, final_dir: str, recipe: dict, find_problem: Callable[[str], str | None],
           build: Callable[[str], str], upstream_rebuilt: bool) -> bool:
    """Reuse `final_dir` if it is complete and of `recipe`, else rebuild it; returns whether it was rebuilt.

    `build(out_dir)` writes the stage into a fresh side directory and returns a one-line summary; the marker
    (recipe, seconds) is written last and the directory renamed into place, so a crash never leaves a stage
    that looks complete. `upstream_rebuilt`: an earlier stage this one is made from was just rebuilt."""
    problem = _stage_problem(final_dir, recipe, find_problem)
    if problem is None and not upstream_rebuilt:
        _log(f"reusing {name} in {final_dir}")
        return False
    if problem is None:
        _log(f"{name} in {final_dir} was made from an earlier stage that was just rebuilt; rebuilding it")
    elif os.path.exists(final_dir):
        _log(f"{name} in {final_dir} is unusable ({problem}); rebuilding it")
    started = time.perf_counter()
    building_dir = f"{final_dir}.building-{os.getpid()}"
    shutil.rmtree(building_dir, ignore_errors=True)
    summary = build(building_dir)
    _write_json(os.path.join(building_dir, MARKER_FILE),
                {"stage": name, "recipe": recipe, "seconds": round(time.perf_counter() - started, 1)})
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(building_dir, final_dir)
    _log(f"prepared {name} in {final_dir} ({summary}; {time.perf_counter() - started:.0f} s)")
    return True


def _stage_problem(final_dir: str, recipe: dict, find_problem: Callable[[str], str | None]) -> str | None:
    """What makes `final_dir` unusable as the stage built from `recipe`, or None when it can be reused."""
    if not os.path.isdir(final_dir):
        return "missing"
    marker_path = os.path.join(final_dir, MARKER_FILE)
    if not os.path.isfile(marker_path):
        return f"no {MARKER_FILE}: its preparation did not finish, or it was made by hand"
    try:
        with open(marker_path) as f:
            marked_recipe = json.load(f)["recipe"]
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable {MARKER_FILE} ({err})"
    if marked_recipe != recipe:
        changed = sorted(key for key in set(recipe) | set(marked_recipe) if recipe.get(key) != marked_recipe.get(key))
        return f"built with another recipe: {', '.join(changed)} differ"
    return find_problem(final_dir)


def _data_problem(data_dir: str) -> str | None:
    for name in ("train.parquet", "test.parquet", "sft_train.parquet", "sft_test.parquet"):
        path = os.path.join(data_dir, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        try:
            if pq.read_metadata(path).num_rows == 0:
                return f"{name} has no rows"
        except Exception as err:  # pyarrow raises several types for a damaged file
            return f"{name} is not readable parquet ({type(err).__name__}: {err})"
    return None


def model_dir_problem(model_dir: str) -> str | None:
    """Cheap checks that catch a deleted or truncated file before transformers would fail on it."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        try:
            with open(path) as f:
                json.load(f)
        except ValueError as err:
            return f"{name} is not valid JSON ({err})"
    return safetensors_problem(os.path.join(model_dir, "model.safetensors"))


# ---- the three builds ----

def _build_data(out_dir: str, recipe: DefaultRecipe) -> str:
    from hybridrl.reward.scorers.reasoning_gym import make_train_test_rows
    from hybridrl.data.rl_parquet import write_rl_parquet

    _log(f"preparing data: reasoning-gym {recipe.task} {json.dumps(recipe.task_config)}, {recipe.train_size} train "
         f"and up to {recipe.test_size} held-out test questions")
    train_rows, test_rows = make_train_test_rows(recipe.task, recipe.train_size, recipe.test_size, recipe.seed,
                                                 recipe.task_config)
    write_rl_parquet(train_rows, os.path.join(out_dir, "train.parquet"))
    write_rl_parquet(test_rows, os.path.join(out_dir, "test.parquet"))
    write_sft_parquet(sft_rows_from_rl(train_rows, recipe.tagged_fraction), os.path.join(out_dir, "sft_train.parquet"))
    write_sft_parquet(sft_rows_from_rl(test_rows, recipe.tagged_fraction), os.path.join(out_dir, "sft_test.parquet"))
    return f"{len(train_rows)} train, {len(test_rows)} test rows"


def sft_rows_from_rl(rl_rows: list[dict], tagged_fraction: float) -> list[dict]:
    """Chat rows {"messages": prompt + assistant answer} for RL rows of a task graded by <answer></answer>.

    Exactly round(tagged_fraction * n) rows, spread evenly (row i is tagged when floor((i+1)f) > floor(if)),
    answer `<answer>N</answer>`; the others answer `The answer is N.` (see the module docstring for why).
    """
    if not 0.0 <= tagged_fraction <= 1.0:
        raise ValueError(f"tagged_fraction must be in [0, 1], got {tagged_fraction}")
    rows = []
    for position, row in enumerate(rl_rows):
        answer = row["reward_model"]["ground_truth"]
        tagged = int((position + 1) * tagged_fraction) > int(position * tagged_fraction)
        content = f"<answer>{answer}</answer>" if tagged else f"The answer is {answer}."
        rows.append({"messages": list(row["prompt"]) + [{"role": "assistant", "content": content}]})
    return rows


def write_sft_parquet(rows: list[dict], path: str) -> None:
    """Write chat rows (a `messages` column) to `path`, creating its directory."""
    import pyarrow as pa

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _build_init_model(out_dir: str, paths: DefaultPaths, recipe: DefaultRecipe) -> str:
    from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer

    _log(f"preparing tiny model: tokenizer (vocab <= {recipe.vocab_size}) trained on the task text, Qwen2 with "
         f"hidden {recipe.hidden_size}, {recipe.num_layers} layers")
    conversations = pq.read_table(paths.sft_train_file).column("messages").to_pylist()
    texts = [f"{message['role']}\n{message['content']}" for messages in conversations for message in messages]
    tokenizer = build_tokenizer(texts, vocab_size=recipe.vocab_size)
    build_tiny_model(out_dir, tokenizer, arch="qwen2", hidden_size=recipe.hidden_size, num_layers=recipe.num_layers,
                     num_heads=recipe.num_heads, num_kv_heads=recipe.num_kv_heads,
                     intermediate_size=recipe.intermediate_size, seed=recipe.model_seed)
    num_params = count_elements(os.path.join(out_dir, "model.safetensors"))
    return f"{num_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}"


def _sft_config(paths: DefaultPaths, recipe: DefaultRecipe):
    """hybridrl/config/sft_trainer.yaml on this cache's files, with the recipe's overrides."""
    from hybridrl.trainer.main_sft import compose_sft_config

    return compose_sft_config({
        "data.train_files": [paths.sft_train_file], "data.val_files": [paths.sft_val_file],
        "model.partial_pretrain": paths.init_model_dir, "trainer.logger": ["jsonl"],
        "trainer.n_gpus_per_node": _sft_ranks(), **recipe.sft_overrides})


def _sft_settings(sft_config) -> dict:
    """The effective SFT settings (YAML defaults + overrides) for the marker, so that editing sft_trainer.yaml
    rebuilds the warm start too; the paths are left out: they only say where this cache is."""
    settings = dataclasses.asdict(sft_config)
    for group, key in (("data", "train_files"), ("data", "val_files"), ("model", "partial_pretrain"),
                       ("trainer", "default_local_dir")):
        del settings[group][key]
    del settings["cache_dir"]
    return settings


def _build_sft_model(out_dir: str, sft_config) -> str:
    from hybridrl.trainer.main_sft import run_sft

    run_root = f"{out_dir}.run"
    sft_config.trainer.default_local_dir = run_root
    _log(f"preparing SFT warm start: {sft_config.trainer.total_training_steps or 'all'} steps on "
         f"{sft_config.trainer.n_gpus_per_node} ranks (python -m hybridrl.trainer.main_sft)")
    shutil.rmtree(run_root, ignore_errors=True)
    model_dir = run_sft(sft_config)
    os.replace(model_dir, out_dir)
    shutil.move(os.path.join(run_root, "metrics.jsonl"), os.path.join(out_dir, SFT_METRICS_FILE))
    shutil.rmtree(run_root)
    with open(os.path.join(out_dir, SFT_METRICS_FILE)) as f:
        last = [json.loads(line) for line in f][-1]
    return f"final train loss {last['train/loss']:.3f}" + (
        f", val loss {last['val/loss']:.3f}" if "val/loss" in last else "")


def _sft_ranks() -> int:
    """2 data-parallel ranks (the CPU demo), fewer when fewer GPUs are visible."""
    import torch

    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def _same_path(first: str, second: str) -> bool:
    return os.path.abspath(os.path.expanduser(first)) == os.path.abspath(os.path.expanduser(second))


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)


def _log(message: str) -> None:
    print(f"[hybridrl] {message}", flush=True)


def main() -> None:
    """`python -m hybridrl.defaults.assets [--cache_dir DIR]`: prepare (or check) the embedded default."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--cache_dir", default=os.environ.get("HYBRIDRL_CACHE_DIR", "~/.cache/hybridrl"),
                        help="default: $HYBRIDRL_CACHE_DIR, else ~/.cache/hybridrl (the configs' cache_dir)")
    paths = prepare_default_assets(parser.parse_args().cache_dir)
    print(f"[hybridrl] data: {paths.train_file}, {paths.val_file}\n[hybridrl] model: {paths.sft_model_dir}")


if __name__ == "__main__":
    main()
