import importlib
import sys

from b12x_inductor._kernels_shadow import load_installed_kernels
from b12x_inductor.bench import SUITES

load_installed_kernels()  # run from the checkout's root, before a suite imports transformers

args = sys.argv[1:]
suite = args.pop(0) if args and args[0] in SUITES else "kernels"
try:
    module = importlib.import_module(f"b12x_inductor.bench.{suite}")
except ModuleNotFoundError as e:
    if e.name != f"b12x_inductor.bench.{suite}":
        raise
    sys.exit(f"b12x_inductor.bench: suite {suite!r} is not built yet")
module.main(args)
