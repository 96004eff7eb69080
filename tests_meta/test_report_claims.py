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
