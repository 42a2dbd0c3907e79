"""ListFiles, GetFile, PutFile: every status, and a table of hostile paths."""

from __future__ import annotations

import os

import pytest
from agent_harness import Agent, S, content


def put(agent: Agent, data: bytes, path: str | None = None, filename: str = "up.bin") -> object:
    form = {"path": path} if path is not None else None
    return agent.client.post(f"{S}/files", files={"file": (filename, data)}, data=form)


def test_put_get_list_roundtrip(agent: Agent) -> None:
    r = put(agent, b"hello", "files/a/b.txt")
    assert r.status_code == 201
    assert r.json() == {"path": "files/a/b.txt", "size_bytes": 5}
    got = agent.client.get(f"{S}/files", params={"path": "files/a/b.txt"})
    assert got.status_code == 200 and got.content == b"hello"
    assert got.headers["content-type"].startswith("text/plain")
    listing = agent.client.get(f"{S}/files/list", params={"path": "files/a"}).json()["files"]
    assert [(f["path"], f["size_bytes"], f["type"]) for f in listing] == [("files/a/b.txt", 5, "file")]
    root = agent.client.get(f"{S}/files/list").json()["files"]
    assert {"path": "files", "type": "directory"}.items() <= next(f for f in root if f["path"] == "files").items()
    derived = put(agent, b"{}", filename="data.json")
    assert derived.json() == {"path": "data.json", "size_bytes": 2}
    assert agent.client.get(f"{S}/files", params={"path": "data.json"}).headers["content-type"] == "application/json"
    # The sandboxed code sees the upload and may overwrite it.
    assert content(agent.sh("cat files/a/b.txt; echo bye > files/a/b.txt"))["stdout"] == "hello"
    assert agent.client.get(f"{S}/files", params={"path": "files/a/b.txt"}).content == b"bye\n"


def test_statuses(agent: Agent) -> None:
    put(agent, b"x", "st/f.txt")
    assert agent.client.get(f"{S}/files", params={"path": "st"}).status_code == 400
    assert agent.client.get(f"{S}/files", params={"path": "st"}).json()["reason"] == "is_a_directory"
    assert agent.client.get(f"{S}/files", params={"path": "st/none"}).status_code == 404
    assert agent.client.get(f"{S}/files/list", params={"path": "nodir"}).status_code == 404
    assert agent.client.get(f"{S}/files/list", params={"path": "st/f.txt"}).status_code == 404
    assert agent.client.get(f"{S}/files").status_code == 422  # path is required
    assert put(agent, b"x", "st").status_code == 400  # a directory is in the way
    no_file = agent.client.post(f"{S}/files", data={"path": "st/g.txt"}, files={"other": ("g", b"x")})
    assert no_file.status_code == 422
    assert not (agent.workspace / "st/g.txt").exists()


def test_get_file_accepts_a_produced_file_id(agent: Agent) -> None:
    result = agent.py("import os\nos.makedirs('out', exist_ok=True)\nopen('out/chart.png', 'wb').write(b'PNG')")
    refs = content(result)["content"]
    assert refs == [{"type": "code_execution_output", "file_id": "out/chart.png", "filename": "chart.png"}]
    got = agent.client.get(f"{S}/files", params={"path": refs[0]["file_id"]})
    assert got.status_code == 200 and got.content == b"PNG"
    assert got.headers["content-type"] == "image/png"


HOSTILE = [
    ("../escape.txt", 403),
    ("a/../../escape.txt", 403),
    ("..\\escape.txt", 403),
    ("/etc/passwd", 403),
    ("C:\\Windows\\win.ini", 403),
    ("c:relative", 403),
    ("nul\x00byte", 403),
    ("", 422),
]


@pytest.mark.parametrize(("path", "status"), HOSTILE)
def test_hostile_paths_are_refused_everywhere(agent: Agent, path: str, status: int) -> None:
    get = agent.client.get(f"{S}/files", params={"path": path})
    assert get.status_code == status
    assert "/tmp" not in get.text and str(agent.workspace) not in get.text
    listing = agent.client.get(f"{S}/files/list", params={"path": path})
    assert listing.status_code == status
    before = sorted(os.listdir(agent.workspace.parent))
    assert put(agent, b"evil", path).status_code == status
    assert sorted(os.listdir(agent.workspace.parent)) == before


def test_symlinks_made_inside_the_sandbox(agent: Agent) -> None:
    agent.sh("mkdir -p links && echo inside > links/real.txt && ln -sf real.txt links/ok "
             "&& ln -sf /etc/hostname links/out && ln -sfn / links/rootdir")
    ok = agent.client.get(f"{S}/files", params={"path": "links/ok"})
    assert ok.status_code == 200 and ok.content == b"inside\n"
    for path in ("links/out", "links/rootdir/etc/passwd"):
        refused = agent.client.get(f"{S}/files", params={"path": path})
        assert refused.status_code == 403, path
        assert "/etc" not in refused.json()["detail"].replace(path, "")
    assert agent.client.get(f"{S}/files/list", params={"path": "links/rootdir"}).status_code == 403
    # Writing through a symlink that points out is refused, and the target is untouched.
    assert put(agent, b"pwned", "links/rootdir/tmp/pwned").status_code == 403
    assert not os.path.exists("/tmp/pwned")
    entries = agent.client.get(f"{S}/files/list", params={"path": "links"}).json()["files"]
    listing = {f["path"]: f["type"] for f in entries}
    assert listing["links/out"] == "symlink"


def test_fifo_and_other_non_regular_files_are_refused(agent: Agent) -> None:
    agent.sh("mkfifo pipe")
    resp = agent.client.get(f"{S}/files", params={"path": "pipe"}, timeout=10)
    assert resp.status_code == 400
    assert resp.json()["reason"] == "not_a_regular_file"
    assert content(agent.py("print(1)"))["stdout"] == "1\n"  # nothing blocked


def test_upload_over_cap_writes_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    from agent_harness import start_agent

    small = start_agent(tmp_path_factory.mktemp("small"), "--max-upload-bytes", "1000",
                        "--max-read-bytes", "2000", "--max-request-bytes", "4096")
    try:
        over = small.client.post(f"{S}/files", files={"file": ("f", b"x" * 1001)}, data={"path": "big.bin"})
        assert over.status_code == 413
        assert over.json()["reason"] == "payload_too_large"
        assert os.listdir(small.workspace) == []
        # Far over the cap: refused on the declared length, before the body is read.
        huge = small.client.post(f"{S}/files", files={"file": ("f", b"x" * 300_000)}, data={"path": "huge.bin"})
        assert huge.status_code == 413
        assert os.listdir(small.workspace) == []
        ok = small.client.post(f"{S}/files", files={"file": ("f", b"x" * 1000)}, data={"path": "big.bin"})
        assert ok.status_code == 201
        # Reads over the read cap are refused.
        small.sh("head -c 3000 /dev/zero > large.bin")
        assert small.client.get(f"{S}/files", params={"path": "large.bin"}).status_code == 413
        # Exec bodies over the request cap: declared length, and streamed without one.
        big_code = {"tool": "code_execution", "input": {"code": "#" * 5000}}
        assert small.client.post(f"{S}/exec", json=big_code).status_code == 413

        def chunks():
            yield b'{"tool": "code_execution", "input": {"code": "'
            for _ in range(10):
                yield b"#" * 1000
            yield b'"}}'

        assert small.client.post(f"{S}/exec", content=chunks()).status_code == 413

        def multipart_chunks():  # an upload without Content-Length, far over the cap
            yield b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\n"
            for _ in range(100):
                yield b"y" * 1000
            yield b"\r\n--B--\r\n"

        streamed = small.client.post(f"{S}/files", content=multipart_chunks(),
                                     headers={"content-type": "multipart/form-data; boundary=B"})
        assert streamed.status_code == 413
        assert sorted(os.listdir(small.workspace)) == ["big.bin", "large.bin"]
        assert content(small.py("print('fine')"))["stdout"] == "fine\n"
    finally:
        small.stop()


def test_upload_file_name_cannot_steer_the_path(agent: Agent) -> None:
    r = put(agent, b"n", filename="../../named-evil.txt")
    assert r.status_code == 201 and r.json()["path"] == "named-evil.txt"
    assert (agent.workspace / "named-evil.txt").read_bytes() == b"n"
    assert not (agent.workspace.parent / "named-evil.txt").exists()
    assert put(agent, b"n", filename="..").status_code in (403, 422)
    unknown = agent.client.get(f"{S}/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["reason"] == "not_found"
