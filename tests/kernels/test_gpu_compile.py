"""Every kernel compiles for every target a hardware profile names, in the specializations the
interpreter ran: sm_80 and sm_90 in the default tier, sm_86, sm_89, sm_100 and sm_120 in the slow one."""
import pytest

from megacompile.kernels import check
from megacompile.kernels.gpu_compile import ARCHS, FAST_ARCHS, compile_launches


def _compile(archs):
    rows = check.run("test", compile_gpu=False)
    assert not check.uncovered(rows), "kernels that no check case launches"
    launches = {x.key: x for r in rows for x in r.launches}
    results = compile_launches(launches.values(), archs=archs)
    failures = [
        f"{launches[key].kernel} {launches[key].signature} sm_{arch}: {result}"
        for key, per_arch in results.items() for arch, result in per_arch.items() if result != "ok"
    ]
    assert not failures, "\n".join(failures)
    assert all(set(per_arch) == set(archs) for per_arch in results.values())


def test_every_kernel_compiles_to_ptx_for_sm80_and_sm90():
    _compile(FAST_ARCHS)


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in FAST_ARCHS])
def test_every_kernel_compiles_for_the_other_profiles_targets(arch):
    _compile((arch,))
