"""The report claims only what the run saw (#19.7): a kernel-class tick in report.md's checklist is
a count of this run's served calls; a trainer with no kernel mode (nothing counted) gets "[?] not
observed", never "[x]"."""
from __future__ import annotations

from fixtures.plugin import report as R


def _lines(served, unserved=None):
    inv = {"kernels": {"attention": ["aten._scaled_dot_product_flash_attention_for_cpu"], "matmul": ["aten.mm"]},
           "served": served, "unserved": unserved or {}}
    return {line.split("`")[1]: line for line in R.checklist({"inventories": {"m": inv}}, {}, None) if "`" in line}


def test_no_counter_is_never_a_tick():
    lines = _lines({})
    assert all(line.startswith("- [?]") for line in lines.values()), lines
    assert "not CountsServedOps" in lines["attention"]


def test_a_tick_is_a_count_of_this_run():
    lines = _lines({"aten.mm": {"matmul": 3}, "aten._scaled_dot_product_flash_attention_for_cpu": {"other": 2}})
    assert lines["matmul"].startswith("- [x]") and "3 calls served this run" in lines["matmul"]
    assert lines["attention"].startswith("- [?]"), "served by another kernel is not this kernel's claim"


def test_unserved_calls_are_an_open_box():
    lines = _lines({"aten.mm": {"matmul": 3}}, unserved={"aten.mm": 1})
    assert lines["matmul"].startswith("- [ ]") and "UNSERVED: aten.mm" in lines["matmul"]


def test_time_section_sums_engine_starts_per_check():
    """The report's "Where the time went": worker time per gate, engine starts counted and timed,
    the slowest checks first with their share."""
    from fixtures.plugin.report import time_section
    checks = [{"nodeid": "a", "gate": "C4", "duration_s": 40.0, "costs": {"engine start": {"n": 2, "s": 30.0}}},
              {"nodeid": "b", "gate": "C5", "duration_s": 5.0},
              {"nodeid": "c", "gate": "C4", "duration_s": 10.0, "costs": {"engine start": {"n": 1, "s": 8.0}}}]
    text = "\n".join(time_section(checks, wall_s=30.0))
    assert "worker time 55 s over 3 checks (wall 30 s); per gate: C4 50 s, C5 5 s" in text
    assert "- engine start: 3 taking 38 s" in text
    assert text.index("| `a` | 40.0 | 2 engine starts 30 s |") < text.index("| `c` | 10.0 | 1 engine start 8 s |")
    assert time_section([]) == []


def test_time_section_says_where_engine_starts_went():
    """The engine starts' phases (timed in the worker) summed for the run, and what lies outside them."""
    from fixtures.plugin.report import time_section
    checks = [{"nodeid": "a", "gate": "C4", "duration_s": 40.0, "costs": {"engine start": {
                   "n": 2, "s": 30.0, "parts": {"load weights": 10.0, "profile run": 6.0}}}},
              {"nodeid": "c", "gate": "C4", "duration_s": 10.0, "costs": {"engine start": {
                   "n": 1, "s": 8.0, "parts": {"load weights": 5.0, "profile run": 1.0}}}}]
    text = "\n".join(time_section(checks))
    assert ("- engine start: 3 taking 38 s; of which load weights 15 s, profile run 7 s; the rest 16 s "
            "(outside them: the client, the pipe, the suite's probes, retries)") in text, text


def test_time_section_says_what_a_rare_cost_was_about():
    """A cost seen at most costs.WHATS_KEPT times in the run prints what it was about (where C8's
    reference ran, which worker variables were new); a frequent one (engine starts) does not."""
    from fixtures.runtime import costs
    from fixtures.plugin.report import time_section
    ref = costs.summarise([{"kind": "C8 reference gradients", "s": 33.0, "what": "float32 on cuda:0 (float64 does not fit)"}])
    starts = costs.summarise([{"kind": "engine start", "s": 1.0, "what": f"engine {i}"} for i in range(5)])
    assert starts["engine start"]["what"] == ["engine 0", "engine 1", "engine 2"]      # bounded
    checks = [{"nodeid": "a", "gate": "C8", "duration_s": 40.0, "costs": ref},
              {"nodeid": "b", "gate": "C4", "duration_s": 9.0, "costs": starts}]
    text = "\n".join(time_section(checks))
    assert "- C8 reference gradients: 1 taking 33 s: float32 on cuda:0 (float64 does not fit)" in text, text
    assert "- engine start: 5 taking 5 s\n" in text + "\n" and "engine 0" not in text, text


def test_time_section_names_the_worker_that_set_the_wall_time():
    """Per xdist worker: its checks' seconds, its idle seconds and its last check - the worker that
    ended last first. Control: one worker (or none recorded) prints no worker line."""
    from fixtures.plugin.report import time_section
    checks = [{"nodeid": "t.py::a", "gate": "C9", "duration_s": 80.0, "worker": "gw0", "span_s": [5.0, 85.0]},
              {"nodeid": "t.py::b", "gate": "C9", "duration_s": 10.0, "worker": "gw0", "span_s": [85.0, 95.0]},
              {"nodeid": "t.py::c", "gate": "C2", "duration_s": 30.0, "worker": "gw1", "span_s": [0.0, 60.0]}]
    text = "\n".join(time_section(checks, wall_s=96.0))
    assert ("- workers (last to end first): gw0 2 checks, 90 s in them, idle 5 s, last ended at 95 s (`b`); "
            "gw1 1 checks, 30 s in them, idle 30 s, last ended at 60 s (`c`)") in text, text
    alone = [dict(c, worker="gw0") for c in checks]
    assert "- workers" not in "\n".join(time_section(alone, wall_s=96.0))


def test_time_section_says_how_much_cpu_a_check_used():
    """A check's own process's CPU seconds beside its wall: far under it, the check waited; far over
    it, threads spun in parallel. Summed for the run on the first line. Control: checks without the
    figure print neither."""
    from fixtures.plugin.report import time_section
    checks = [{"nodeid": "a", "gate": "C8", "duration_s": 20.0, "cpu_s": 0.4},
              {"nodeid": "b", "gate": "C2", "duration_s": 5.0, "cpu_s": 19.6}]
    text = "\n".join(time_section(checks, wall_s=21.0))
    assert "worker time 25 s over 2 checks (wall 21 s; the checks' pytest processes used 20 s of CPU)" in text, text
    assert "| `a` | 20.0 | its process's CPU 0.4 s |" in text and "| `b` | 5.0 | its process's CPU 19.6 s |" in text
    bare = "\n".join(time_section([{k: v for k, v in c.items() if k != "cpu_s"} for c in checks], wall_s=21.0))
    assert "CPU" not in bare, bare
