"""
A tiny command-line "agent" for CLI adapter tests.

Reads the prompt from stdin and prints it back one word at a time, every
FAKE_CLI_DELAY seconds (default 0). Writes its pid to FAKE_CLI_PIDFILE when
set. A prompt of "fail" exits 3 after writing to stderr. A `--session ID`
argument is echoed first as "[session ID] ".
"""

import os
import sys
import time


def main():
    if os.environ.get("FAKE_CLI_PIDFILE"):
        with open(os.environ["FAKE_CLI_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    prompt = sys.stdin.read()
    if prompt.strip() == "fail":
        sys.stderr.write("fake cli: asked to fail\n")
        sys.exit(3)
    if "--session" in sys.argv:
        sys.stdout.write(f"[session {sys.argv[sys.argv.index('--session') + 1]}] ")
    delay = float(os.environ.get("FAKE_CLI_DELAY", "0"))
    for word in prompt.split(" "):
        sys.stdout.write(word + " ")
        sys.stdout.flush()
        if delay:
            time.sleep(delay)


if __name__ == "__main__":
    main()
