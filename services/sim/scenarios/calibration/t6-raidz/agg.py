import re,glob,statistics,collections
d=collections.defaultdict(list); spread=collections.defaultdict(list)
for f in glob.glob('t6-*.log'):
    m=re.match(r'(?:.*/)?t6-(\w)-(\w+)-(2\.\d)-(\d)\.log',f)
    if not m: continue
    model,bs,ver,rep=m.groups()
    t=open(f).read()
    mm=re.search(r'# throughput fill: logical_MiB=([\d.]+) elapsed_s=([\d.]+) MiBps=([\d.]+)',t)
    sp=re.search(r'# fill: max_spread_pp=([\d.]+)',t)
    if mm: d[(model,bs,ver)].append(float(mm.group(3)))
    if sp: spread[(model,bs,ver)].append(float(sp.group(1)))
seed={'16K':(3076,3621),'128K':(3773,4638),'1M':(4434,4541)}
for model in 'AB':
    print(f"model {model}: {'memory-speed leaves (CPU-bound)' if model=='A' else 'every leaf a 20 MB/s one-lane device'}")
    print("| block | 2.3 MiB/s median (min-max) | 2.4 MiB/s median (min-max) | 2.4/2.3 | seed 2.4/2.3 | max spread pp 2.3 / 2.4 |")
    print("|---|---|---|---|---|---|")
    for bs in ['16K','128K','1M']:
        a=d[(model,bs,'2.3')]; b=d[(model,bs,'2.4')]
        if not a or not b: continue
        ma,mb=statistics.median(a),statistics.median(b)
        s=seed[bs]
        print(f"| {bs} | {ma:.0f} ({min(a):.0f}-{max(a):.0f}), n={len(a)} | {mb:.0f} ({min(b):.0f}-{max(b):.0f}), n={len(b)} | {mb/ma:.2f} ({(mb/ma-1)*100:+.0f} %) | {s[1]/s[0]:.2f} ({(s[1]/s[0]-1)*100:+.1f} %) | {statistics.median(spread[(model,bs,'2.3')]):.1f} / {statistics.median(spread[(model,bs,'2.4')]):.1f} |")
    print()
