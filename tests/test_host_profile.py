"""benchmarks/host_profile.py's summary of py-spy's raw stacks, against counts worked out by hand."""
from __future__ import annotations

import pytest

from benchmarks.host_profile import function_name, summarize

# 10 samples: 4 in a CUDA sync under step(), 3 in schedule(), 2 in step()'s own Python, 1 in an unnamed libc frame
NATIVE = """\
process 7:"python3 gap.py";thread 0x1 (MainThread);<module> (gap.py:9);step (core.py:40);sync (runner.py:12);cudaStreamSynchronize (libcudart.so.12);? (libcuda.so.1) 4
process 7:"python3 gap.py";thread 0x1 (MainThread);<module> (gap.py:9);step (core.py:41);schedule (scheduler.py:200) 2
process 7:"python3 gap.py";thread 0x1 (MainThread);<module> (gap.py:9);step (core.py:41);schedule (scheduler.py:214) 1
process 7:"python3 gap.py";thread 0x1 (MainThread);<module> (gap.py:9);step (core.py:45) 2
process 7:"python3 gap.py";thread 0x1 (MainThread);<module> (gap.py:9);step (core.py:45);0x7f12c904524a (libc.so.6) 1
"""
PYTHON_ONLY = """\
<module> (gap.py:9);step (core.py:41);schedule (scheduler.py:200) 3
<module> (gap.py:9);step (core.py:45) 1
"""


def write(tmp_path, text: str) -> str:
    path = tmp_path / "profile.raw"
    path.write_text(text)
    return str(path)


def test_native_stacks_give_the_gpu_wait_and_each_view_by_hand(tmp_path):
    summary = summarize(write(tmp_path, NATIVE))
    assert summary["samples"] == 10
    assert summary["gpu_wait_share"] == pytest.approx(0.4)
    leaf = dict(summary["top_leaf"])  # the lines of one function together; unnamed native frames by library
    assert leaf == pytest.approx({"? (libcuda.so.1)": 0.4, "schedule (scheduler.py)": 0.3, "step (core.py)": 0.2,
                                  "? (libc.so.6)": 0.1})
    assert dict(summary["top_python"]) == pytest.approx({"sync (runner.py)": 0.4, "schedule (scheduler.py)": 0.3,
                                                         "step (core.py)": 0.3})
    inclusive = dict(summary["top_inclusive"])  # the process and thread roots are left out
    assert inclusive["step (core.py)"] == pytest.approx(1.0)
    assert inclusive["cudaStreamSynchronize (libcudart.so.12)"] == pytest.approx(0.4)
    assert not any(name.startswith(("process ", "thread ")) for name in inclusive)


def test_python_only_stacks_have_no_gpu_wait_share(tmp_path):
    summary = summarize(write(tmp_path, PYTHON_ONLY))
    assert summary["samples"] == 4
    assert summary["gpu_wait_share"] is None  # only native frames show a wait
    assert summary["top_python"] == [("schedule (scheduler.py)", 0.75), ("step (core.py)", 0.25)]


def test_function_names_drop_the_line_and_unnamed_native_frames_go_by_library():
    assert function_name("schedule (scheduler.py:214)") == "schedule (scheduler.py)"
    assert function_name("0x7f12c904524a (libc.so.6)") == "? (libc.so.6)"
    assert function_name("<module>") == "<module>"


def test_top_keeps_the_largest(tmp_path):
    summary = summarize(write(tmp_path, NATIVE), top=2)
    assert summary["top_leaf"] == [("? (libcuda.so.1)", pytest.approx(0.4)), ("schedule (scheduler.py)",
                                                                              pytest.approx(0.3))]
