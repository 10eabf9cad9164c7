"""A Python code interpreter: each call runs the model's code in a fresh sandboxed process.

Tool YAML `config:` keys (defaults in parentheses; see sandbox.py / sandbox_launcher.py for how):
    timeout_s (10)            wall clock per call; the process group is SIGKILLed past it
    cpu_time_s (5)            RLIMIT_CPU: SIGKILL at this many CPU seconds
    memory_mb (1024)          RLIMIT_AS (address space); a larger allocation raises MemoryError
    file_size_mb (16)         RLIMIT_FSIZE: the largest file
    disk_mb (64)              the private tmpfs (/tmp with the work folder, /dev/shm) in all
    open_files (64)           RLIMIT_NOFILE
    processes (32)            RLIMIT_NPROC (threads); new processes are refused by a seccomp filter
    max_output_bytes (1 MiB)  bytes of output the host keeps from each end before truncating
    max_tool_response_length (2048)   characters of output returned to the model
    tool_response_truncate_side (middle)   left keeps the start, right the end, middle both ends
    allow_network (false)     true: the code shares the host's network namespace (it can reach the
                              network and the host's own TCP/UDP services); every other layer stays
    read_only_paths ([])      host paths the code may read, bound read-only at the same place
    unsafe_no_isolation (false)   true: run WITHOUT namespaces (rlimits and the seccomp filter only; the
                              host's files, processes and network are open); warns at every call
The sandbox is probed once when the tool is built, so a machine that cannot build it fails at config
load with the step that failed, not at the first call; it never falls back to less isolation.

execute({"code": "..."}) returns the combined stdout+stderr, followed by a status line when the
code did not exit 0 ("[exit code 1]", "[killed: wall-clock timeout 10 s]", "[killed: CPU time
limit 5 s]", "[killed by SIGSEGV]"). Step reward 0; metrics (all numbers): exit_code (-1 when the
wall clock killed it, 128 + signal for a signal, 152 = 128 + SIGXCPU for the CPU limit), timed_out,
wall_s, output_bytes, leftovers (what cleanup could not remove: processes, the cgroup; 0 expected).
"""
from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.sandbox import (SandboxAccess, SandboxLimits, access_from_config, limits_from_config,
                                    probe_isolation, run_python)
from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from hybridrl.tools.utils.truncate import TRUNCATE_SIDES, truncate_text

CONFIG_KEYS = {"type", "max_tool_response_length", "tool_response_truncate_side",
               *SandboxLimits.__dataclass_fields__, *SandboxAccess.__dataclass_fields__}


class CodeInterpreterTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        unknown = set(config) - CONFIG_KEYS
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; expected keys among {sorted(CONFIG_KEYS)}")
        self.limits = limits_from_config(config)
        self.access = access_from_config(config)
        self.max_tool_response_length = config.get("max_tool_response_length", 2048)
        if isinstance(self.max_tool_response_length, bool) or not isinstance(self.max_tool_response_length, int) \
                or self.max_tool_response_length <= 0:
            raise ValueError(f"max_tool_response_length must be a positive int, got {self.max_tool_response_length!r}")
        self.truncate_side = config.get("tool_response_truncate_side", "middle")
        if self.truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool_response_truncate_side must be one of {list(TRUNCATE_SIDES)}, "
                             f"got {self.truncate_side!r}")
        probe_isolation(self.limits, self.access)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"calls": 0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code") if isinstance(parameters, dict) else None
        if not isinstance(code, str):
            return (ToolResponse(text=f"Error: {self.name} expects arguments {{\"code\": \"<python source>\"}}, "
                                      f"got {parameters!r}"), 0.0, {"malformed_parameters": 1})
        if instance_id in self._instance_dict:
            self._instance_dict[instance_id]["calls"] += 1
        result = await run_python(code, self.limits, self.access)
        text = truncate_text(result.output, self.max_tool_response_length, self.truncate_side)
        status = self._status_line(result)
        metrics = {"exit_code": -1 if result.exit_code is None else result.exit_code,
                   "timed_out": int(result.timed_out), "wall_s": result.wall_s,
                   "output_bytes": result.output_bytes, "leftovers": result.leftovers}
        return ToolResponse(text=text + status if text else status.lstrip("\n")), 0.0, metrics

    def _status_line(self, result) -> str:
        if result.timed_out:
            return f"\n[killed: wall-clock timeout {self.limits.timeout_s:g} s]"
        if result.exit_code == 0:
            return ""
        if result.signal_name == "SIGXCPU":
            return f"\n[killed: CPU time limit {self.limits.cpu_time_s} s]"
        if result.signal_name:
            return f"\n[killed by {result.signal_name}]"
        return f"\n[exit code {result.exit_code}]"

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
