import sys

from .peers import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "peers":
        sys.exit("usage: python -m megacompile.bench peers [--tiny] [--out DIR] [--steps N] [--minutes M] ...")
    sys.exit(main(args[1:]))
