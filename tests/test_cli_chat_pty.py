"""`zoo run`'s interactive chat in a real terminal (a pty): readline history (the up arrow recalls a prompt),
/reset, /help, an empty line that does not quit, Ctrl-C that stops a reply and returns to the prompt, and a
second Ctrl-C at the empty prompt that quits."""
import os
import pty
import re
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from test_cli_run import save_chat_model

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "w1 w2 w3"


class Terminal:
    """`python -m zoo.cli ARGS` on the slave side of a pty (its controlling terminal: Ctrl-C is a SIGINT)."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TERM": "xterm", "HF_HUB_OFFLINE": "1"}
        pid, fd = pty.fork()
        if pid == 0:  # the child: become zoo
            try:  # as a shell starts a foreground job: Ctrl-C's SIGINT at its default, even when this
                signal.signal(signal.SIGINT, signal.SIG_DFL)  # pytest runs in a background job (SIGINT ignored)
                os.chdir(ROOT)
                os.execve(sys.executable, [sys.executable, "-m", "zoo.cli", *args], env)
            finally:
                os._exit(127)
        self.pid, self.fd, self.out, self.seen = pid, fd, "", 0

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        """Wait for `pattern` in the output after the last match (bounded); the match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.compile(pattern).search(self.out, self.seen)
            if m:
                self.seen = m.end()
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} within {timeout} s; the terminal shows:\n{self.out[-3000:]}"
            if select.select([self.fd], [], [], min(left, 0.5))[0]:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # EIO: the child is gone
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the terminal closed before {pattern!r}:\n{self.out[-3000:]}")
                self.out += chunk.decode(errors="replace").replace("\r\n", "\n")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait_at_prompt(self, timeout: float = 30) -> None:
        """Wait until the child sleeps in readline's select(). CPython's readline prints the prompt, then selects on
        stdin with no timeout: a SIGINT between the two only sets a flag, and the Ctrl-C is not seen until the next
        key (a user types it again; under load the child can sit in that window long enough for this test's
        Ctrl-C to land there). Its main thread sleeping on three looks 50 ms apart means it is past the window."""
        deadline, asleep = time.monotonic() + timeout, 0
        while asleep < 3:
            assert time.monotonic() < deadline, f"zoo run never waited at its prompt:\n{self.out[-3000:]}"
            time.sleep(0.05)
            with open(f"/proc/{self.pid}/stat") as f:  # the state follows the parenthesised command name
                asleep = asleep + 1 if f.read().rsplit(")", 1)[1].split()[0] == "S" else 0

    def exit_status(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # (keep draining the pty so that the child never blocks on a full buffer)
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.out += os.read(self.fd, 65536).decode(errors="replace")
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        self.kill()
        raise AssertionError(f"zoo run did not exit within {timeout} s:\n{self.out[-3000:]}")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        if self.fd >= 0:  # (exit_status kills before it raises; the test's finally kills again)
            os.close(self.fd)
            self.fd = -1


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("pty"), max_position_embeddings=65536)


def test_history_reset_help_and_empty_lines(chat_model):
    t = Terminal("run", str(chat_model), "--max-tokens", "3", "--ignore-eos")
    try:
        t.expect(r"/help for commands")
        t.expect(r"> ")
        t.type(PROMPT + "\r")
        first = int(t.expect(r"zoo: 3 tokens, .* prompt (\d+) tokens").group(1))
        t.expect(r"> ")
        t.type("\x1b[A\r")  # the up arrow: readline recalls the last prompt, Enter sends it again
        t.expect(re.escape(PROMPT))
        second = int(t.expect(r"zoo: 3 tokens, .* prompt (\d+) tokens").group(1))
        assert second > 2 * first - 2  # the first turn is in the conversation now
        t.expect(r"> ")
        t.type("\r")  # an empty line: nothing happens, the prompt comes back
        t.expect(r"> ")
        t.type("/help\r")
        t.expect(r"/reset\s+forget the conversation")
        t.type("/reset\r")
        t.expect(r"zoo: conversation reset")
        t.type(PROMPT + "\r")
        assert int(t.expect(r"zoo: 3 tokens, .* prompt (\d+) tokens").group(1)) == first
        t.expect(r"> ")
        t.type("/exit\r")
        assert t.exit_status() == 0
    finally:
        t.kill()


def test_ctrl_c_stops_a_reply_and_twice_at_the_prompt_quits(chat_model):
    t = Terminal("run", str(chat_model), "--max-tokens", "60000", "--ignore-eos")  # a reply of minutes: more than a pty buffer holds
    try:
        t.expect(r"> ")
        t.type(PROMPT + "\r")
        t.expect(re.escape(PROMPT) + r"\n")  # (the echo)
        t.expect(r"w\d+ w\d+ w\d+")  # the reply is streaming
        t.type("\x03")
        t.expect(r"zoo: interrupted")
        t.expect(r"> ")
        t.wait_at_prompt()
        t.type("\x03")  # at the empty prompt, after an interrupted reply: quits
        assert t.exit_status() == 0
        assert "60000 tokens" not in t.out  # the reply did not run to its end
    finally:
        t.kill()
