"""bench/kernels.py's w4a16 cases: shapes the kernels take, and the benchmark's refusal without a GPU."""

from bench import kernels
from bench.kernels_quant import QUANT_CASES
from loraledger.gpu.backend import cuda_problem
from loraledger.quantization.device_layout import load_granule


def test_every_case_is_a_layout_the_kernels_read():
    for case in QUANT_CASES:
        assert case.k % case.group == 0 and case.group % load_granule(case.bits) == 0, case.name
    targets = [c for c in QUANT_CASES if c.target is not None]
    assert targets and all(c.rows == 1 and c.bits == 4 and c.model == "8B" for c in targets)


def test_the_w4a16_group_is_selectable_and_needs_a_gpu(capsys):
    assert "w4a16" in kernels.CASE_GROUPS
    if cuda_problem() is None:
        return
    assert kernels.main(["--cases", "w4a16"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
