"""Load plans of whole 1-D uint8 tensors of given sizes in one file, for the pure tests of how
a plan's chunks are ordered."""

from foxhunt_stream.format.dtypes import DTYPES
from foxhunt_stream.format.header import TensorInfo
from foxhunt_stream.format.plan import LoadPlan, Selection, plan_load


def plan_of_sizes(sizes, chunk: int) -> LoadPlan:
    """Tensors t0, t1... of ``sizes`` bytes, back to back, cut into chunks of ``chunk`` bytes."""
    sels, pos = [], 0
    for i, n in enumerate(sizes):
        sels.append(Selection(0, 0, TensorInfo(f"t{i}", DTYPES["U8"], (n,), pos, pos + n)))
        pos += n
    return plan_load(sels, chunk)
