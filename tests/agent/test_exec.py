"""code_execution and bash_code_execution against a real agent: state, failures, timeouts, floods."""

from __future__ import annotations

import random

from agent_harness import Agent, content
from testkit import survivors


def test_python_state_persists_and_output_is_captured_at_fd_level(agent: Agent) -> None:
    first = agent.py("import os, subprocess\nx = 41\nprint('py')\nos.write(1, b'raw\\n')\n"
                     "subprocess.run(['echo', 'child'])\nimport sys\nprint('err', file=sys.stderr)")
    c = content(first)
    assert c["stdout"] == "py\nraw\nchild\n"
    assert c["stderr"] == "err\n"
    assert c["return_code"] == 0
    assert first["result_block"]["type"] == "code_execution_tool_result"
    assert first["tool_use_id"].startswith("srvtoolu_")
    assert first["result_block"]["tool_use_id"] == first["tool_use_id"]
    assert isinstance(first["execution_time_ms"], int)
    second = agent.py("print(x + 1, os.getcwd() == os.environ['HOME'])", tool_use_id="mine")
    assert content(second)["stdout"] == "42 True\n"
    assert second["tool_use_id"] == "mine" and second["result_block"]["tool_use_id"] == "mine"


def test_python_exception_is_a_failed_result(agent: Agent) -> None:
    resp = agent.exec("code_execution", code="def f():\n    raise ValueError('boom')\nf()")
    assert resp.status_code == 200
    assert resp.headers["X-Sandpool-Outcome"] == "failed"
    c = content(resp.json())
    assert c["return_code"] == 1
    assert "ValueError: boom" in c["stderr"] and "Traceback" in c["stderr"]
    assert "runner.py" not in c["stderr"]
    syntax = content(agent.py("def ("))
    assert syntax["return_code"] == 1 and "SyntaxError" in syntax["stderr"]
    exited = content(agent.py("import sys\nsys.exit(3)"))
    assert exited["return_code"] == 3
    assert content(agent.py("print('still here')"))["stdout"] == "still here\n"


def test_python_exit_ends_the_cell_not_the_interpreter(agent: Agent) -> None:
    """`exit()` and `sys.exit()` answer as the reference backend does (issue 32): the code as the
    return code, nothing added to stderr, the interpreter and its state kept. Only the process
    itself ending (`os._exit`) starts a new interpreter, and that call says so."""
    agent.py("survivor = 'kept'")
    codes = {"exit(4)": 4, "quit()": 0, "import sys; sys.exit(0)": 0, "import sys; sys.exit()": 0,
             "raise SystemExit(3)": 3, "exit(300)": 300, "exit(-1)": -1, "import sys; sys.exit('msg')": 1,
             "import sys; sys.exit([1])": 1, "import sys; sys.exit('7')": 7, "import sys; sys.exit(2.5)": 2}
    answers = {code: agent.py(f"print('before')\n{code}") for code in codes}
    assert {code: (content(a)["stdout"], content(a)["stderr"], content(a)["return_code"], "interpreter_restarted" in a)
            for code, a in answers.items()} == {code: ("before\n", "", rc, False) for code, rc in codes.items()}
    after = agent.py("print(survivor)")
    assert content(after)["stdout"] == "kept\n" and "interpreter_restarted" not in after
    ended = agent.py("import os; os._exit(5)")
    assert content(ended)["return_code"] == 5
    assert content(ended)["stderr"] == "[sandpool: the interpreter exited with status 5; a new one was started]\n"
    assert ended["interpreter_restarted"] is True
    fresh = agent.py("print('survivor' in globals())")
    assert content(fresh)["stdout"] == "False\n" and fresh["interpreter_restarted"] is True


def test_no_secret_in_the_sandbox_environment(agent: Agent) -> None:
    c = content(agent.py("import os\nprint(sorted(k for k in os.environ if 'SANDPOOL' in k or 'SECRET' in k))"))
    assert c["stdout"] == "[]\n"
    c = content(agent.sh("env"))
    assert agent.secret not in c["stdout"] and "SANDPOOL" not in c["stdout"]


def test_bash_state_persists_and_framing_survives_hostile_input(agent: Agent) -> None:
    assert content(agent.sh("mkdir -p sub && cd sub && export FOO=bar"))["return_code"] == 0
    c = content(agent.sh("pwd; echo $FOO"))
    assert c["stdout"].splitlines()[1] == "bar"
    assert c["stdout"].splitlines()[0].endswith("/sub")
    broken = content(agent.sh("echo 'unbalanced"))
    assert broken["return_code"] != 0
    heredoc = content(agent.sh("cat <<EOF\nno end marker"))
    assert "no end marker" in heredoc["stdout"]
    assert content(agent.sh("read line; echo got=$?"))["stdout"] == "got=1\n"  # stdin is /dev/null
    c = content(agent.sh("printf '0\\n'; echo done; echo $FOO; cd .."))
    assert c["stdout"] == "0\ndone\nbar\n"
    failing = agent.exec("bash_code_execution", command="echo out; echo err >&2; false")
    assert failing.headers["X-Sandpool-Outcome"] == "failed"
    assert content(failing.json()) | {"content": []} == {"type": "code_execution_result", "stdout": "out\n",
                                                          "stderr": "err\n", "return_code": 1, "content": []}


def test_bash_exit_restarts_the_shell_and_says_so(agent: Agent) -> None:
    agent.sh("export KEEP=1")
    result = agent.sh("echo bye; exit 7")
    assert content(result)["return_code"] == 7
    assert content(result)["stdout"] == "bye\n"
    assert result["shell_restarted"] is True
    after = agent.sh("echo [$KEEP]")
    assert content(after)["stdout"] == "[]\n"
    assert agent.sh("true").get("shell_restarted") is None


def test_python_timeout_interrupts_and_keeps_state(agent: Agent) -> None:
    agent.py("kept = 'yes'")
    resp = agent.exec("code_execution", code="import time\nprint('before', flush=True)\ntime.sleep(30)",
                      timeout=1)
    assert resp.headers["X-Sandpool-Outcome"] == "timeout"
    body = resp.json()
    c = content(body)
    assert c["return_code"] == 124
    assert c["stdout"] == "before\n"
    assert "timeout" in c["stderr"] and "1s limit" in c["stderr"]
    assert body["limit_exceeded"] == "timeout"
    assert body["timeout_seconds"] == 1
    nxt = agent.py("print(kept)")
    assert content(nxt)["stdout"] == "yes\n"
    assert "interpreter_restarted" not in nxt


def test_python_timeout_kills_sigint_ignoring_code_and_escaped_children(agent: Agent) -> None:
    agent.py("lost = 1")
    code = (
        "import os, signal, subprocess, time\n"
        "kids = [subprocess.Popen(['sleep', '300']).pid,\n"
        "        subprocess.Popen(['setsid', 'sleep', '301']).pid,\n"
        "        subprocess.Popen(['bash', '-c', 'sleep 302 & echo $!'], stdout=subprocess.PIPE)]\n"
        "grand = int(kids[2].stdout.readline())\n"
        "print(kids[0], kids[1], grand, flush=True)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "while True: time.sleep(1)\n"
    )
    result = agent.py(code, timeout=1)
    c = content(result)
    assert c["return_code"] == 124
    assert result["interpreter_restarted"] is True
    assert "killed" in c["stderr"]
    pids = [int(p) for p in c["stdout"].split()]
    assert len(pids) == 3
    assert survivors(pids, timeout=5.0) == []
    nxt = agent.py("print('lost' in globals())")
    assert content(nxt)["stdout"] == "False\n"
    assert nxt["interpreter_restarted"] is True
    assert "interpreter_restarted" not in agent.py("pass")


def test_bash_timeout_keeps_shell_state_and_kills_background_children(agent: Agent) -> None:
    agent.sh("export STAY=here")
    tag = f"{random.randrange(10**6):06d}"  # unique, so parallel runs of this suite never see each other's
    result = agent.sh(f"(setsid sleep 303.{tag} &); sleep 304.{tag} & echo $!; sleep 60", timeout=1)
    c = content(result)
    assert c["return_code"] == 124
    assert result["limit_exceeded"] == "timeout"
    assert survivors([int(c["stdout"].split()[0])], timeout=5.0) == []
    lingering = content(agent.sh(f"pgrep -f 'sleep 30[34].{tag}' || echo none"))["stdout"]
    assert lingering == "none\n"
    assert content(agent.sh("echo $STAY"))["stdout"] == "here\n"


def test_bash_timeout_of_a_builtin_loop_restarts_the_shell(agent: Agent) -> None:
    result = agent.sh("while :; do :; done", timeout=1)
    assert content(result)["return_code"] == 124
    assert result["shell_restarted"] is True
    assert content(agent.sh("echo ok"))["stdout"] == "ok\n"


def test_timeout_is_clamped_to_the_ceiling(agent: Agent) -> None:
    clamped = agent.py("pass", timeout=10_000)["timeout_seconds"]
    assert clamped == 300 and isinstance(clamped, int)
    assert agent.py("pass")["timeout_seconds"] == 60
    assert agent.py("pass", timeout=5)["timeout_seconds"] == 5


def test_forged_completions_cannot_desynchronise_the_shell(agent: Agent) -> None:
    # The program writes a completion-shaped line on the shell's own status channel, then keeps running.
    forged = agent.sh("printf '1 0\\n' >&$__sandpool_out; printf '999999 0\\n' >&$__sandpool_out; echo real")
    assert content(forged)["stdout"] in ("real\n", "")
    for word in ("one", "two", "three"):
        result = content(agent.sh(f"echo {word}"))
        assert result["stdout"] == f"{word}\n" and result["return_code"] == 0


def test_a_fork_inside_a_cell_does_not_answer_for_the_interpreter(agent: Agent) -> None:
    agent.py("state = 'kept'")
    result = content(agent.py("import os\npid = os.fork()\nif pid == 0:\n    print('child')\nelse:\n"
                              "    os.waitpid(pid, 0)\n    print('parent')"))
    assert result["stdout"] == "child\nparent\n"
    for _ in range(3):
        assert content(agent.py("print(state)"))["stdout"] == "kept\n"


def test_a_stopped_interpreter_does_not_hang_the_agent(agent: Agent) -> None:
    pid = int(content(agent.py("import os\nprint(os.getpid())"))["stdout"])
    agent.sh(f"kill -STOP {pid}")
    big = "x = 1\n" + "#" * (2 << 20)  # larger than a pipe buffer: the request itself cannot be written
    result = agent.py(big, timeout=1)
    assert content(result)["return_code"] == 124
    assert result["interpreter_restarted"] is True
    assert agent.client.get("/healthz").status_code == 200
    assert content(agent.py("print('fresh')"))["stdout"] == "fresh\n"


def test_interpreter_survives_a_cell_that_closes_fds_1_and_2(agent: Agent) -> None:
    agent.py("kept = 'state'")
    closed = agent.exec("code_execution", code="import os\nos.close(1)\nos.close(2)")
    assert closed.status_code == 200
    assert content(closed.json())["return_code"] == 0
    after = content(agent.py("import os, subprocess, sys\nprint(kept)\nos.write(1, b'raw\\n')\n"
                             "subprocess.run(['echo', 'child'])\nprint('err', file=sys.stderr)"))
    assert after["stdout"] == "state\nraw\nchild\n" and after["stderr"] == "err\n", after
    assert "interpreter_restarted" not in after
    # Closed again, and a traceback to report in the same cell: still a result, still the same interpreter.
    failing = content(agent.py("import os\nos.close(1)\nos.close(2)\nraise ValueError('after close')"))
    assert failing["return_code"] == 1 and "ValueError: after close" in failing["stderr"]
    # Python-level streams closed or swapped for a broken object are put back too.
    content(agent.py("import sys\nsys.stdout.close()\nsys.stderr = None"))
    again = content(agent.py("print(kept)\nraise KeyError('k')"))
    assert again["stdout"] == "state\n" and "KeyError: 'k'" in again["stderr"], again


def test_output_redirected_by_a_cell_comes_back_for_the_next_one(agent: Agent) -> None:
    content(agent.py("import os\nsink = os.open(os.devnull, os.O_WRONLY)\nos.dup2(sink, 1)\nprint('lost')"))
    assert content(agent.py("print('seen')"))["stdout"] == "seen\n"
    sh = content(agent.sh("exec 1>&- 2>&-; echo gone"))
    assert sh["stdout"] == ""
    sh = content(agent.sh("export AFTER=1; echo out; echo err >&2"))
    assert sh["stdout"] == "out\n" and sh["stderr"] == "err\n" and "shell_restarted" not in sh


def test_an_interpreter_that_closed_every_copy_of_its_output_is_replaced(agent: Agent) -> None:
    # Every descriptor on the two output pipes, the runner's private copies included.
    closing = agent.py(
        "import os\n"
        "pipes = {os.readlink('/proc/self/fd/1'), os.readlink('/proc/self/fd/2')}\n"
        "for fd in map(int, os.listdir('/proc/self/fd')):\n"
        "    try:\n"
        "        if os.readlink(f'/proc/self/fd/{fd}') in pipes: os.close(fd)\n"
        "    except OSError:\n"
        "        pass\n")
    assert content(closing)["return_code"] == 0
    # Its output can no longer be captured: the next call runs in a fresh interpreter, and says so.
    fresh = agent.py("print('captured')")
    assert content(fresh)["stdout"] == "captured\n"
    assert closing.get("interpreter_restarted") is True and fresh.get("interpreter_restarted") is True


def test_functions_named_like_the_shell_loops_commands_do_not_break_it(agent: Agent) -> None:
    # The classic fork bomb names its function `:`; a loop running `while :` would call it.
    defined = content(agent.sh(":() { echo colon; }; true() { echo true; }; read() { echo myread; }\n"
                               "printf() { echo myprintf; }; eval() { echo myeval; }; builtin() { echo b; }\n"
                               "trap() { echo mytrap; }; echo defined"))
    assert defined["stdout"] == "defined\n" and defined["return_code"] == 0
    after = content(agent.sh("echo still; :; read; printf x"))
    assert after["stdout"] == "still\ncolon\nmyread\nmyprintf\n", after
    interrupted = agent.sh("sleep 30", timeout=1)
    assert interrupted["limit_exceeded"] == "timeout" and "shell_restarted" not in interrupted
    assert content(agent.sh("unset -f : true read printf eval trap; echo clean"))["stdout"] == "clean\n"
