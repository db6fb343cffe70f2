"""`megacompile plan --run` of a vision-language run plans the images its data shows (train/run_images.py):
the most images a record shows per row and the largest image as the run reads it, planned as the
same flags plan them; the flags, where given, win; a run's pixel limits scale what is read; the
sizes are read from the images' headers as the run's scaling makes them."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from megacompile.cli import main
from megacompile.train.data import pixels
from tests.train import files, qwen_files, vlm_files
from tests.train.test_run_plan import TIMED


def _run_yaml(tmp_path, **more) -> str:
    model = qwen_files.model_dir(str(tmp_path / "model"))
    data = qwen_files.records(str(tmp_path / "data.jsonl"), n=6, text_every=3)
    settings = dict(model=model, data=[data], seq=32, batch=2, steps=1, hbm_budget=1, compute_dtype="float32",
                    device="cpu", run_dir=str(tmp_path / "run")) | more
    return files.run_yaml(str(tmp_path / "r.yaml"), **settings)


def _plan(capsys, *argv) -> tuple[dict, str]:
    assert main(["plan", *argv, "--hardware", "cpu", "--json"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err


def test_a_qwen_run_is_planned_with_its_datas_images_as_the_flags_plan_them(tmp_path, capsys):
    """Red and green 16 x 16, blue 16 x 8, one a record: planned as one 16 px image a row, the plan
    the flags make, its grid the folder's processor's (4 tokens, as the run writes red); with
    image_max_pixels 128 the largest image read is blue (red and green scale to 11 x 11), a 12 px
    square of its pixels."""
    path = _run_yaml(tmp_path)
    derived, said = _plan(capsys, "--run", path)
    assert ("images         from the run's data: 4 record(s) with images, at most 1 in one, the largest 16 x 16 px "
            "as the run reads it, the heaviest 1 image(s) filling 4 tokens: planned as 1 per row of 16 x 16 px") in said
    flagged, said = _plan(capsys, "--run", path, "--images-per-row", "1", "--image-size", "16")
    assert "from the run's data" not in said
    same = TIMED | {"vision"}       # its shares are timings; its images are compared below
    assert {k: v for k, v in derived.items() if k not in same} == {k: v for k, v in flagged.items() if k not in same}
    assert derived["vision"]["images"] == flagged["vision"]["images"]
    assert derived["vision"]["images"]["images_per_row"] == 1
    assert derived["vision"]["images"]["tokens_per_image"] == qwen_files.TOKENS["red"]
    scaled, said = _plan(capsys, "--run", path, "image_max_pixels=128")
    assert ("the largest 16 x 8 px as the run reads it, the heaviest 1 image(s) filling 2 tokens: planned as 1 per "
            "row of 12 x 12 px") in said
    assert scaled["vision"]["images"]["image_size"] == 12
    given, _ = _plan(capsys, "--run", path, "--images-per-row", "2", "--image-size", "16")   # the flags win
    assert given["vision"]["images"]["images_per_row"] == 2


def test_a_run_with_images_is_planned_in_the_host_budget_its_pixels_leave(tmp_path, capsys):
    """As the run places the engine's state (Stage.host_beside): the pixels kept for images read
    again and a micro-batch's pixel inputs come out of the run's host_budget first, the line the
    run prints said; with the largest images in the heaviest rows, the plan's figure is the run's."""
    from megacompile.train import load
    from megacompile.train.data.images import PixelCache
    from megacompile.train.stages.sft import SFTStage
    path = _run_yaml(tmp_path, host_budget=2)
    planned, said = _plan(capsys, "--run", path)
    stage = SFTStage(load(path, []), str(tmp_path / "run"))
    try:
        held = stage.host_beside(None, "cpu")
    finally:
        stage.discard()
    assert [b.nbytes for b in held] == [PixelCache.LIMIT, 2 * 16 * 96 * 4]     # 2 rows of a 4 x 4 grid's patches
    taken = sum(b.nbytes for b in held)
    assert planned["host_budget_bytes"] == int((2 * 2 ** 30 - taken) / 2 ** 30 * 2 ** 30)
    assert ("host budget    2.00 GiB: " in said and "beside it (processed pixels kept for the images read again, "
            "at most: 256.00 MiB; a micro-batch's pixel inputs, 2 rows of 1 images of 16 px: 12.00 KiB)" in said)


def test_a_qwen_run_plans_its_heaviest_record_not_its_most_images_beside_its_largest(tmp_path, capsys):
    """The folder's processor resizes within 32 x 32 px: a 64 x 64 image fills 16 tokens, three
    16 x 16 ones 12 together, two 40 x 40 ones 32. The plan's row is the heaviest record's (16
    tokens, then 32), where three of the largest image (48 tokens) would pass the rows of 40
    tokens that every record fits in and the plan would refuse the run."""
    path = _run_yaml(tmp_path, seq=40)
    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "images" / "big.png")
    Image.new("RGB", (40, 40), (30, 200, 30)).save(tmp_path / "images" / "mid.png")

    def record(*names):
        marks = " ".join("<image>" for _ in names)
        return json.dumps({"messages": [{"role": "user", "content": f"{marks} what colour is this"},
                                        {"role": "assistant", "content": "this is red"}],
                           "images": [f"images/{n}.png" for n in names]}) + "\n"
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write(record("big") + record("red", "green", "red"))
    planned, said = _plan(capsys, "--run", path)
    assert ("at most 3 in one, the largest 64 x 64 px as the run reads it, the heaviest 1 image(s) filling 16 tokens: "
            "planned as 1 per row of 64 x 64 px") in said
    assert planned["vision"]["images"]["images_per_row"] == 1 and planned["vision"]["images"]["tokens_per_image"] == 16
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write(record("mid", "mid"))
    planned, said = _plan(capsys, "--run", path)
    assert "the heaviest 2 image(s) filling 32 tokens: planned as 2 per row of 64 x 64 px" in said
    assert planned["vision"]["images"]["images_per_row"] == 2 and planned["vision"]["images"]["tokens_per_image"] == 16


def test_a_cpu_run_without_a_budget_is_planned_at_the_budget_its_images_need(tmp_path, capsys):
    """device: cpu without hbm_budget: the run takes the smallest plan of its heaviest rows when that
    is more than budget_fraction of its weights, so its plan holds the images it plans: a 64 x 64
    image (16 tokens against the others' 4) fits at the budget planned."""
    path = _run_yaml(tmp_path, hbm_budget=None, budget_fraction=0.01, seq=40)
    Image.new("RGB", (64, 64), (200, 30, 30)).save(tmp_path / "images" / "big.png")
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "<image> what colour is this"},
                                         {"role": "assistant", "content": "this is red"}],
                            "images": ["images/big.png"]}) + "\n")
    planned, said = _plan(capsys, "--run", path)
    assert "hbm_budget not given" in said and planned["vision"]["images"]["tokens_per_image"] == 16
    assert planned["fits"], said


def test_the_most_images_of_a_record_are_a_rows_and_a_text_run_plans_none(tmp_path, capsys):
    path = _run_yaml(tmp_path)
    with open(tmp_path / "data.jsonl", "a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "<image> <image> what colour is this"},
                                         {"role": "assistant", "content": "this is red"}],
                            "images": ["images/red.png", "images/blue.png"]}) + "\n")
    planned, said = _plan(capsys, "--run", path)
    assert "5 record(s) with images, at most 2 in one" in said and planned["vision"]["images"]["images_per_row"] == 2
    text = files.run_yaml(str(tmp_path / "text.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                          data=[files.chats(str(tmp_path / "chats.jsonl"))], seq=16, batch=2, steps=1, hbm_budget=1,
                          device="cpu", run_dir=str(tmp_path / "text-run"))
    planned, said = _plan(capsys, "--run", text)
    assert "from the run's data" not in said and planned["vision"] is None


@pytest.mark.slow   # a LLaVA folder and its CLIP tower planned twice
def test_a_llava_run_plans_its_largest_images_longest_side(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    vlm_files.model_dir("model")
    vlm_files.records("data.jsonl")
    path = files.run_yaml("r.yaml", model="model", data=["data.jsonl"], seq=64, batch=2, steps=1, hbm_budget=1,
                          device="cpu", run_dir="run")
    largest = max(Image.open(p).size for p in vlm_files.images(".").values())
    planned, said = _plan(capsys, "--run", path)
    assert f"planned as 1 per row of {max(largest)} x {max(largest)} px" in said
    assert planned["vision"]["images"]["image_size"] == max(largest)


@pytest.mark.parametrize("size", [(640, 480), (17, 3), (3000, 20), (8, 8)])
@pytest.mark.parametrize("limits", [pixels.Limits(), pixels.Limits(max_pixels=4096),
                                    pixels.Limits(min_pixels=1024), pixels.Limits(max_pixels=300, min_pixels=290)])
def test_the_size_read_from_a_header_is_the_size_the_run_scales_an_image_to(size, limits):
    assert pixels.fitted_size(*size, limits) == pixels.fit(Image.new("RGB", size), limits).size


def test_a_thin_images_tokens_are_planned_on_a_square_that_fills_them():
    """Qwen's processor rounds a 1000 x 15 image's short side up to a 28 px patch: 36 tokens, more than
    a square of its pixels (123 px) fills; the square grows until it fills them, and stops where the
    processor's largest image holds no more."""
    from megacompile.train.run_images import _square

    def tokens(w, h, most=28 * 28 * 64):         # 2 x 2 patches of 14 px merged into a token
        w, h = max(28, round(w / 28) * 28), max(28, round(h / 28) * 28)
        while w * h > most:
            w, h = max(28, w - 28), max(28, h - 28)
        return (w // 28) * (h // 28)
    assert tokens(1000, 15) == 36 and tokens(123, 123) < 36
    side = _square(tokens, 36, 1, (1000, 15))
    assert tokens(side, side) >= 36 and tokens(side - 28, side - 28) < 36
    capped = _square(tokens, 100, 1, (1000, 15))         # more than the processor's largest image makes
    assert tokens(capped, capped) == 64
