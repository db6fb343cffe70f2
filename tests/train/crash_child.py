"""`megacompile train --config RUN_YAML`, killed with SIGKILL right after the CSV row of step
KILL_AT is written: the process dies as a crash or an OOM killer would end it."""
import os
import signal
import sys

from megacompile.cli import main
from megacompile.train import log

config, kill_at = sys.argv[1], int(sys.argv[2])
write = log.RunLog.write


def write_then_die(self, row, **more):
    write(self, row, **more)
    if row["step"] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


log.RunLog.write = write_then_die
sys.exit(main(["train", "--config", config]))
