"""Worker functions used only by tests of the launcher itself."""

import os
import time


def sleep_forever(task_index, num_workers, pid_file):
    with open(pid_file, "a") as f:
        f.write(f"{os.getpid()}\n")
    while True:
        time.sleep(1)
