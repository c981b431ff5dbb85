import json, sys, glob, os
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(out, "*.json"))):
    side = os.path.basename(f).split("_")[0]
    d = json.load(open(f))
    for rec in d["results"]:
        name = rec["contender"]
        rows.setdefault((name, "window"), {}).setdefault(side, []).append(rec["ratio_vs_native"])
        if name != "py_drop":
            rows.setdefault((name, "side"), {}).setdefault(side, []).append(rec["optimizer_side_ratio_vs_native"])
for (name, what), sides in sorted(rows.items()):
    print(f"{name:14s} {what:6s} " + "  ".join(f"{s}: " + ", ".join(f"{v:.3f}" for v in sides.get(s, [])) for s in ("before", "after")))
