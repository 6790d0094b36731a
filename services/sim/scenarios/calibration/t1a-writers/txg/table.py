# Makes the per-run table of t1a-writers/README.md from the per-txg timing
# files (zbal -T, see zbal-txg.patch) and their logs: python3 table.py *.txg.csv
import csv, sys, re, os
print("| run | MiB/s | txgs | txg MiB median (1st/2nd half) | sync share of wall | data wait share of sync | tail ms/txg | gap ms/txg | MiB/s while syncing (1st/2nd half) | writer CPU µs/block | process CPU µs/block | CPUs used while syncing |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for fn in sys.argv[1:]:
    allr = list(csv.DictReader(l for l in open(fn) if not l.startswith('#')))
    if 'writer_cpu_ms' not in allr[0]: continue
    r = [x for x in allr if float(x['app_MiB']) > 1 and float(x['datawait_ms']) > 0]
    F = lambda rr, c: [float(x[c]) for x in rr]
    med = lambda v: sorted(v)[len(v)//2]
    log = open(fn.replace('.txg.csv', '.log')).read()
    m = re.search(r'# phase fill done: ([\d.]+) MiB in ([\d.]+) s .* = ([\d.]+) MiB/s', log)
    wall = float(m.group(2)); rate = float(m.group(3))
    sync = sum(F(r, 'sync_ms')); dw = sum(F(r, 'datawait_ms'))
    tail = [float(x['sync_ms'])-float(x['pre_ms'])-float(x['issue_ms'])-float(x['datawait_ms']) for x in r]
    gap = [float(x['quiesce_ms'])+float(x['wait_ms']) for x in r]
    app = sum(F(r, 'app_MiB')); blocks = app * 8
    wc = sum(F(r, 'writer_cpu_ms')); pc = sum(F(r, 'proc_cpu_sync_ms'))
    n = len(r); h1, h2 = r[:n//2], r[n//2:]
    hr = lambda rr: sum(F(rr,'app_MiB'))/(sum(F(rr,'sync_ms'))/1e3)
    name = os.path.basename(fn).replace('.txg.csv','')
    print(f"| {name} | {rate:.0f} | {n} | {med(F(h1,'app_MiB')):.0f}/{med(F(h2,'app_MiB')):.0f} | {sync/1e3/wall*100:.0f} % | {dw/sync*100:.0f} % | {med(tail):.1f} | {med(gap):.1f} | {hr(h1):.0f}/{hr(h2):.0f} | {wc/blocks*1e3:.0f} | {pc/blocks*1e3:.0f} | {pc/sync:.2f} |")
