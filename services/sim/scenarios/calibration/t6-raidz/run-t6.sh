#!/bin/sh
# Test 6 on real OpenZFS: RAIDZ1 of file leaves, 2.3 vs 2.4, interleaved.
# Model A: memory-speed leaves (CPU-bound). Model B: every leaf a 20 MB/s
# one-lane device (-L), 3 vdevs so the 15 leaves fit the 16 vdev-file threads.
cd "${ZBAL_DIR:-scratch/zfs}"  # where out/zbal-2.x were built (harness build.sh)
mkdir -p runs vdevs
for rep in 1 2 3; do
  for model in A B; do
    for bs in 16K 128K 1M; do
      case $bs in 1M) c=1M;; *) c=256K;; esac
      case $model in
        A) V="-v 256M,256M,256M,256M"; L="";;
        B) V="-v 256M,256M,256M"; L="-L 20M";;
      esac
      for ver in 2.4 2.3; do
        log=runs/t6-$model-$bs-$ver-$rep.log
        nice -n 10 out/zbal-$ver -Z 5 $V $L -b $bs -c $c -t 16 -D 64M -f 0.6 \
          -d vdevs -p t6$model > $log 2> ${log%.log}.err
        echo "$(date +%T) $model $bs $ver rep$rep rc=$? $(grep '^# throughput' $log)"
      done
    done
  done
done
