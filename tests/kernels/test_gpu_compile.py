"""Every kernel compiles for sm_80 and sm_90 in the specializations the interpreter ran."""
from megacompile.kernels import check
from megacompile.kernels.gpu_compile import ARCHS, compile_launches


def test_every_kernel_compiles_to_ptx_for_sm80_and_sm90():
    rows = check.run("test", compile_gpu=False)
    assert not check.uncovered(rows), "kernels that no check case launches"
    launches = {x.key: x for r in rows for x in r.launches}
    results = compile_launches(launches.values())
    failures = [
        f"{launches[key].kernel} {launches[key].signature} sm_{arch}: {result}"
        for key, per_arch in results.items() for arch, result in per_arch.items() if result != "ok"
    ]
    assert not failures, "\n".join(failures)
    assert all(set(per_arch) == set(ARCHS) for per_arch in results.values())
