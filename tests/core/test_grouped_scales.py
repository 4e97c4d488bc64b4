"""Where a grouped GEMM's scales go (fp8fx.core.grouped), for every form, side and granularity."""

from __future__ import annotations

import pytest

from fp8fx.core import grouped
from fp8fx.core.recipes import GRANULARITIES


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("form", sorted(set(grouped.FORMS.values())))
@pytest.mark.parametrize("side", [0, 1])
def test_blocks_along_the_grouped_dim_name_it_so_groups_can_be_padded(granularity, form, side):
    spec = GRANULARITIES[granularity]
    block = (spec.left, spec.right)[side]
    scales = grouped.operand_scales(form, side, block)
    dim = grouped.GROUP_DIMS[form][side]
    if scales.align > 1:  # padding each group needs the dimension the groups split
        assert scales.group_dim == dim is not None and block[dim] == scales.align
    if dim is None:  # one matrix per group: never padded, blocks within each matrix
        assert scales.align == 1 and not scales.per_group
