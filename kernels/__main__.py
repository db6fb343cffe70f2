"""python -m megacompile.kernels --check: every kernel against its reference, and the GPU compile."""
import argparse
import sys
import time
import warnings


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megacompile.kernels", description=__doc__)
    parser.add_argument("--check", action="store_true", help="run every kernel against its reference (interpreter "
                        "without a GPU) at odd shapes in fp32 and bf16, and compile each for sm_80 and sm_90")
    parser.add_argument("--size", choices=("check", "test"), default="check",
                        help="'test' uses the small pytest shapes")
    parser.add_argument("--only", help="run only the kernels whose name contains this")
    parser.add_argument("--no-compile", action="store_true", help="skip the sm_80/sm_90 compile")
    return parser


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not args.check:
        parser().print_help()
        return 0

    from .check import format_table, run, uncovered  # after argparse: importing the kernels sets up triton

    # the interpreter evaluates exp with numpy, which warns where fp32 overflows to the inf the
    # kernels rely on (sigmoid(-100) = 1 / (1 + inf) = 0), as the GPU does silently
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")

    start = time.perf_counter()
    rows = run(args.size, compile_gpu=not args.no_compile, only=args.only)
    print(format_table(rows))
    missing = [] if args.only else uncovered(rows)
    if missing:
        print(f"kernels no case launched: {', '.join(missing)}")
    failed = [r for r in rows if not r.passed]
    ok = not failed and not missing
    print(f"{len(rows) - len(failed)}/{len(rows)} passed in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
