"""The run's tokenizer travels by digest: served by the bootstrap and data nodes, fetched by a data node
that lacks it, checked on arrival (a file of another digest is rejected and logged, never used), cached."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hivemind.p2p import PeerID
from swarm_harness import LocalTestSwarm, NodeProcess, python_env
from transport_harness import running_swarm

from protocols.messages import Error, Rpc, decode, encode
from protocols.transfers import MAX_TOKENIZER_BYTES, TokenizerRequest, TokenizerTransfer
from swarmnode.cli import main
from swarmnode.tokenizer import file_digest, train_tokenizer
from swarmnode.tokenizer_fetch import (
    TokenizerFetchError,
    TokenizerServer,
    cached_path,
    fetch_tokenizer,
    pack,
    unpack,
)

TEXT = "".join(f"def function_{i}(value):\n    return value * {i} + {i % 7}\n\n" for i in range(900))


def custom_tokenizer(path: Path, vocab_size: int = 300, text: str = TEXT) -> Path:
    path.write_text(train_tokenizer([text], vocab_size).to_str())
    return path


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 4099])
def test_bytes_survive_packing_into_int32(size: int) -> None:
    data = bytes(range(256)) * (size // 256 + 1)
    data = data[:size]
    packed = pack(data)
    assert packed.dtype == torch.int32 and packed.numel() == (size + 3) // 4
    assert unpack([packed], size) == data
    with pytest.raises(ValueError, match="int32"):
        unpack([packed], size + 4)
    with pytest.raises(ValueError, match="one tensor"):
        unpack([packed, packed], size)


def test_the_server_refuses_another_digest_and_malformed_requests(tmp_path: Path) -> None:
    server = TokenizerServer("run-t", custom_tokenizer(tmp_path / "t.json"))
    peer = PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))

    async def ask(meta: bytes) -> object:
        reply, tensors = await server.serve(peer, meta, [])
        return decode(reply), tensors

    answer, tensors = asyncio.run(ask(encode(TokenizerRequest("run-t", "f" * 16))))
    assert isinstance(answer, Error) and "not ffff" in answer.reason and tensors == []
    answer, _ = asyncio.run(ask(encode(TokenizerRequest("other-run", server.digest))))
    assert isinstance(answer, Error) and "other-run" in answer.reason
    answer, _ = asyncio.run(ask(b"\x81\xa1v\x01"))
    assert isinstance(answer, Error)
    answer, tensors = asyncio.run(ask(encode(TokenizerRequest("run-t", server.digest))))
    assert isinstance(answer, TokenizerTransfer) and answer.digest == server.digest
    assert unpack(tensors, answer.size) == (tmp_path / "t.json").read_bytes()


def test_a_file_of_another_digest_is_rejected_and_the_next_peer_asked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    honest_file = custom_tokenizer(tmp_path / "run.json")
    forged = custom_tokenizer(tmp_path / "forged.json", 280).read_bytes()
    digest = file_digest(honest_file)

    async def liar(
        peer: PeerID, meta: bytes, tensors: list[torch.Tensor]
    ) -> tuple[bytes, list[torch.Tensor]]:
        asked = decode(meta, TokenizerRequest)  # claims the digest asked for, sends other bytes
        return encode(TokenizerTransfer(asked.run_id, asked.digest, len(forged))), [pack(forged)]

    cache = tmp_path / "cache"
    with running_swarm() as swarm, caplog.at_level(logging.INFO, "swarmnode.tokenizer_fetch"):
        swarm.server.register(Rpc.TOKENIZER, liar)
        TokenizerServer("run-t", honest_file).register(swarm.lenient)
        peers = [str(swarm.server.peer_id), str(swarm.lenient.peer_id)]
        path = swarm.run(fetch_tokenizer(swarm.libp2p, "run-t", digest, peers, cache))
        assert path == cached_path(cache, digest) and path.read_bytes() == honest_file.read_bytes()
        rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
        assert len(rejected) == 1 and str(swarm.server.peer_id)[-8:] in rejected[0], caplog.text
        path.unlink()
        with pytest.raises(TokenizerFetchError, match=f"digest {digest}.*--tokenizer"):
            swarm.run(fetch_tokenizer(swarm.libp2p, "run-t", digest, peers[:1], cache))
        assert not path.exists()  # nothing of the liar's was kept


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_data_node_without_the_file_fetches_the_bootstraps_tokenizer(
    swarm: LocalTestSwarm, tmp_path: Path
) -> None:
    """A run on an `hf:` folder with a custom tokenizer: the data node is given nothing but the bootstrap's
    address, reads the data the run definition describes and fetches the tokenizer into an empty cache."""
    folder = tmp_path / "dataset"
    folder.mkdir()
    rows = TEXT.split("\n\n") * 2
    (folder / "train.jsonl").write_text("".join(json.dumps({"body": row}) + "\n" for row in rows))
    tokenizer = custom_tokenizer(tmp_path / "custom.json")
    digest = file_digest(tokenizer)
    data = ["--data", f"hf:{folder}", "--text-column", "body"]
    bootstrap = swarm.bootstrap("--tokenizer", str(tokenizer), *data, steps=2)
    run = bootstrap.events("bootstrap")[0]["run"]
    assert run["vocab_size"] == 300 and run["tokenizer_digest"] == digest
    assert run["data_source"]["kind"] == "hf" and run["data_source"]["text_column"] == "body"
    cache = tmp_path / "empty-cache"  # this node has never seen the file
    argv = [swarm.python, "-m", "swarmnode", "join", "--stage", "0", "--initial-peers", str(swarm.peers_file)]
    argv += ["--run-id", swarm.run_id, "--threads", "1", "-v"]
    node = NodeProcess("data", tuple(argv), swarm.folder, {**python_env(), "SWARMNODE_CACHE": str(cache)})
    swarm.nodes.append(node)
    node.wait_event("online", 240)
    fetched = cache / "tokenizers" / f"{digest}.json"
    assert fetched.read_bytes() == tokenizer.read_bytes()
    assert "fetched the run's tokenizer" in node.stderr_tail(200)
    assert list(cache.glob(f"tokens-hf-*-{digest}-train.npy")), sorted(p.name for p in cache.iterdir())


def test_a_tokenizer_too_large_to_travel_is_a_one_line_error(tmp_path: Path) -> None:
    big = tmp_path / "tokenizer.json"
    with big.open("wb") as handle:  # sparse: the size is checked before anything is read
        handle.truncate(MAX_TOKENIZER_BYTES + 1)
    result = CliRunner().invoke(main, ["bootstrap", "--tokenizer", str(big)])
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(errors) == 1 and str(big) in errors[0] and "64 MiB" in errors[0], result.output
