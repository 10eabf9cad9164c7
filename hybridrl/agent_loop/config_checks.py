"""Config checks of the agent loops (rollout.mode=async, or a data_flow.custom_generate_function: data/route.py;
multi-turn), registered with hybridrl.config.checks: loops other than the built-in single-turn one read the raw chat,
the engine server serves the built-in engines, multi-turn runs as an agent loop with a tool-call syntax it parses, the
data flow's partial rollout continues only a default loop that can resume, and before the start every agent-loop YAML
entry imports (its file's verl imports all provided by hybridrl.compat.verl), and the default loop and every agent_name
of the data files are registered."""
from __future__ import annotations

from hybridrl.config.checks import Values, register_check
from hybridrl.config.schema import PPOConfig
from hybridrl.data.route import data_flow_switch, engine_servers_switch


def _engine_servers_switch(values: Values) -> str | None:
    return engine_servers_switch(values("actor_rollout_ref.rollout.mode"),
                                 values("data_flow.custom_generate_function")["name"])


@register_check()
def _engine_server_settings(values: Values, problems: list[str]) -> None:
    """Agent loops on engine servers: they read the raw chat (in rollout.mode=async, where any loop may run, and
    with a default loop other than the built-in single_turn_agent, which reads the dataset's own tokenization); the
    engine server serves the built-in engines; the hf server's requests run unsynchronised across ranks, which only
    FSDP2's whole-model gather allows."""
    why = _engine_servers_switch(values)
    if why is None:
        return
    loop = values("actor_rollout_ref.rollout.agent.default_agent_loop")
    async_mode = values("actor_rollout_ref.rollout.mode") == "async"
    if not values("data.return_raw_chat") and (async_mode or loop != "single_turn_agent"):
        problems.append(f"data.return_raw_chat: expected true with {why} and actor_rollout_ref.rollout.agent."
                        f"default_agent_loop={loop!r} (agent loops get the raw chat messages as raw_prompt), got False")
    custom = values("actor_rollout_ref.rollout.custom_cls")
    if custom.get("path") is not None or custom.get("name") is not None:
        problems.append(f"actor_rollout_ref.rollout.custom_cls: expected null with {why} (the engine server serves "
                        f"the built-in hf, sglang and vllm engines), got {custom!r}")
    if values("actor_rollout_ref.rollout.name") == "hf" and values("actor_rollout_ref.actor.strategy") == "fsdp":
        problems.append(f"actor_rollout_ref.actor.strategy: expected 'fsdp2' with {why} and rollout.name='hf' (each "
                        f"rank's server generates on its own schedule; FSDP1 may gather layers at every step, a "
                        f"collective the ranks would not join together), got 'fsdp'")


@register_check()
def _multi_turn_settings(values: Values, problems: list[str]) -> None:
    """multi_turn: the tool_agent loop runs only as an agent loop (async mode), with a tool-call syntax it parses."""
    from hybridrl.agent_loop.tool_parser import TOOL_PARSERS

    if not values("actor_rollout_ref.rollout.multi_turn.enable"):
        return
    if values("actor_rollout_ref.rollout.mode") != "async":
        problems.append("actor_rollout_ref.rollout.mode: expected 'async' with actor_rollout_ref.rollout.multi_turn."
                        "enable=true (multi-turn rollouts run as agent loops against engine servers), got "
                        f"{values('actor_rollout_ref.rollout.mode')!r}")
    tool_format = values("actor_rollout_ref.rollout.multi_turn.format")
    if tool_format not in TOOL_PARSERS:
        problems.append(f"actor_rollout_ref.rollout.multi_turn.format: expected one of {sorted(TOOL_PARSERS)}, got "
                        f"{tool_format!r}")


@register_check()
def _partial_rollout_loop_can_resume(values: Values, problems: list[str]) -> None:
    """data_flow.partial_rollout continues aborted samples: unless a data_flow rollout or generate function makes
    them, the default loop must be one that can (the single-turn loop, or a loop declaring AgentLoopBase.can_resume,
    as tool_agent does). The loop is looked up as the workers will (built-ins, extensions' @register, the agent-loop
    YAML); when it cannot be found, _check_agent_loops says why."""
    from hybridrl.agent_loop.base import load_agent_loop_config, loop_can_resume

    flow = values("data_flow")
    in_flow = data_flow_switch(flow["enable"], values("algorithm.filter_groups.enable"),
                               values("async_training.mode")) is not None
    generates_itself = any(flow[hook].get("name") is not None for hook in ("rollout_function",
                                                                          "custom_generate_function"))
    loop = values("actor_rollout_ref.rollout.agent.default_agent_loop")
    if not (in_flow and flow["partial_rollout"]) or generates_itself or loop == "single_turn_agent":
        return
    try:
        resumable = loop_can_resume(loop, load_agent_loop_config(values("actor_rollout_ref.rollout.agent."
                                                                        "agent_loop_config_path")))
    except Exception:  # a YAML or loop that does not load: _check_agent_loops reports it, naming the entry
        return
    if not resumable:
        problems.append(f"data_flow.partial_rollout: expected false with actor_rollout_ref.rollout.agent."
                        f"default_agent_loop={loop!r} (the loop does not declare can_resume = True, so its aborted "
                        f"conversation cannot be continued: its groups are generated again; partial rollout continues "
                        f"the single-turn loop, tool_agent, a loop that declares AgentLoopBase.can_resume, or a "
                        f"data_flow.custom_generate_function that can), got True")


@register_check("preflight")
def _check_agent_loops(config: PPOConfig, problems: list[str]) -> None:
    """Import every _target_ of the agent-loop YAML and find the default loop, as the agent-loop workers will: a
    module or class that does not import is refused now, not after the cluster is up."""
    agent = config.actor_rollout_ref.rollout.agent
    if engine_servers_switch(config.actor_rollout_ref.rollout.mode,
                             config.data_flow.custom_generate_function.name) is None:
        return
    from hybridrl.agent_loop.base import load_agent_loop_config, read_agent_loop_entries
    from hybridrl.agent_loop.verl_imports import unprovided_verl_imports

    try:
        entries = read_agent_loop_entries(agent.agent_loop_config_path)
    except Exception as err:  # names the file and the entry
        problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: expected a YAML list of "
                        f"{{name, _target_}} entries, got {agent.agent_loop_config_path!r}: {err}")
        return
    unprovided = [f"actor_rollout_ref.rollout.agent.agent_loop_config_path: expected agent loops whose verl imports "
                  f"hybridrl.compat.verl provides, got entry {position} ({entry['name']!r}) of "
                  f"{agent.agent_loop_config_path}: {line}, which hybridrl does not provide "
                  f"(hybridrl/compat/verl/README.md lists what it does)"
                  for position, entry in enumerate(entries)
                  for line in unprovided_verl_imports(entry["_target_"].rpartition(".")[0])]
    if unprovided:
        problems.extend(unprovided)
        return
    try:
        registry = load_agent_loop_config(agent.agent_loop_config_path)
    except Exception as err:  # names the file and the entry
        problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: expected a YAML whose every "
                        f"_target_ imports, got {agent.agent_loop_config_path!r}: {err}")
        return
    if agent.default_agent_loop not in registry:
        problems.append(f"actor_rollout_ref.rollout.agent.default_agent_loop: expected a registered agent loop "
                        f"(one of {sorted(registry)}), got {agent.default_agent_loop!r}")
    problems += _unregistered_agent_names(config, registry)


def _unregistered_agent_names(config: PPOConfig, registry: dict) -> list[str]:
    """Each data file whose agent_name column names a loop that is not registered (a null row runs the default
    loop). A custom dataset class decides its rows itself: the workers look its names up as they run them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hybridrl.data.config_checks import eval_set_files, files_read

    if config.data.custom_cls.path:
        return []
    problems = []
    for where, path in files_read(config) + eval_set_files(config):
        try:
            if "agent_name" not in pq.read_schema(path).names:
                continue
            names = {name for name in pq.read_table(path, columns=["agent_name"]).column(0).to_pylist() if name}
        except (pa.ArrowException, OSError):  # an unreadable file: data/config_checks.py reports it
            continue
        unknown = sorted(names - set(registry))
        if unknown:
            problems.append(f"{where}: expected agent_name values among the registered agent loops "
                            f"{sorted(registry)}, got {unknown} in {path!r} (register with @register(name) or list "
                            f"them in actor_rollout_ref.rollout.agent.agent_loop_config_path)")
    return problems
