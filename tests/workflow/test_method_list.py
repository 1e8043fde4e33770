"""One list of methods everywhere (workflow/scripts/method_list.py): the README, the docs' home and the methods page
show the registry's list as the script writes it, and a method registered later lands in it by itself."""
from script_loader import load_script

import lowmembp
from lowmembp.methods.registry import _REGISTRY, register

method_list = load_script("workflow/scripts/method_list.py")


def test_every_page_shows_the_registrys_list():
    assert method_list.stale() == [], "run: python workflow/scripts/method_list.py"
    for page, base in method_list.PAGES.items():
        text = (method_list.ROOT / page).read_text()
        shown = text.split(method_list.START, 1)[1].split(method_list.END, 1)[0]
        for name in lowmembp.list_methods():
            assert f"| `{name}` |" in shown, (page, name)
        for link in ("velora.md", "cce.md", "tiled-mlp.md"):
            assert f"]({base}{link})" in shown, (page, link)


def test_a_method_registered_later_lands_in_the_list():
    name = "probe-later"
    register(name, "a method registered after the list was written", options={"width": 3})(lambda model, width=3:
                                                                                           model)
    try:
        assert "| `probe-later` | a method registered after the list was written | `width` (3) |" in \
            method_list.table()
        page = "intro\n" + method_list.START + "\nSTALE LIST\n" + method_list.END + "\nrest\n"
        new = method_list.with_list(page, "methods/")
        assert new.startswith("intro\n") and new.endswith("\nrest\n") and "probe-later" in new and "STALE" not in new
        assert method_list.stale() == list(method_list.PAGES)  # every committed page now lacks it
    finally:
        del _REGISTRY[name]
    assert method_list.method_page("lowmembp-act") == "lowmembp.md" and method_list.method_page("probe") is None
