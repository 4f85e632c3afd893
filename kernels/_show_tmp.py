import json, sys
for path in sys.argv[1:]:
    r = json.load(open(path))
    print(path, " ".join(f"{e['B']}x{e['L']}:" + ",".join(f"s{x['splits']}={x['gpu_us']:.1f}" for x in e['sweep']) for e in r['shapes']))
