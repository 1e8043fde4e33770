"""Choosing a method (workflow/scripts/guide.py -> results/reference/tables/guide.md, included by docs/choosing.md):
the committed page is what the script writes from the committed results, it compares with checkpointing, and a
method or GPU row added to the results, or a method added to the registry, lands in it by itself."""
import shutil

from script_loader import load_script

guide = load_script("workflow/scripts/guide.py")
ROOT = guide.ROOT
COMMITTED = ROOT / "results" / "reference" / "tables" / "guide.md"


def test_the_committed_guide_is_written_from_the_committed_results():
    assert COMMITTED.read_text() == guide.render(), "run: python workflow/scripts/guide.py"
    assert "--8<-- \"tables/guide.md\"" in (ROOT / "docs" / "choosing.md").read_text()


def test_each_family_has_its_table_its_use_lines_and_checkpointing():
    text = guide.render()
    for fam in ("## ViT", "## BERT-style", "## LLaMA-style"):
        section = text.split(fam, 1)[1].split("\n## ", 1)[0]
        assert "| checkpointing |" in section and "- Checkpointing saves" in section, fam
        assert "- Use `" in section and "| lowmembp |" in section, fam
    assert "GPU peak saved" in text.split("## ViT", 1)[1].split("## BERT", 1)[0]
    assert "GPU peak saved" not in text.split("## BERT-style", 1)[1].split("## LLaMA", 1)[0]  # no GPU rows yet


def test_new_results_and_new_methods_land_in_it(tmp_path):
    ref, gpu = tmp_path / "reference", tmp_path / "gpu"
    shutil.copytree(ROOT / "results" / "reference", ref)
    shutil.copytree(ROOT / "results" / "gpu", gpu)
    with open(gpu / "fig1.csv") as f:
        rows = f.read().splitlines()
    lora = next(r for r in rows if r.startswith("fig1-qkv,vit-b16,lora,"))
    head = rows[0].split(",")
    cells = lora.split(",")
    cells[head.index("method")] = "lora+newlever"
    cells[head.index("peak_bytes")] = str(int(cells[head.index("peak_bytes")]) // 10)  # saves 90 %
    with open(gpu / "fig1.csv", "a") as f:
        f.write(",".join(cells) + "\n")
    text = guide.render(ref, gpu, registry=["baseline", "lowmembp", "newlever", "brand-new"])
    vit = text.split("## ViT", 1)[1].split("## BERT", 1)[0]
    assert "| newlever | 90 % | 1.00× |" in vit
    assert "- Use `newlever` when memory is what stops you" in vit
    assert "No figures yet for this family: `brand-new`." in vit
