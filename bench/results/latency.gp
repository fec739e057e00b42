
set terminal pngcairo size 1100,480 font ",10"
set output '/work/main/bench/results/latency.png'
set multiplot layout 1,2 title "outbox-relay: latency against producer rate (single-row commits, 16 producers, batch 500)"
set logscale y
set logscale x
set xlabel "producer rate achieved (rows/s; targets 500, 2000, 5000, 12400)"
set ylabel "milliseconds"
set grid
set key top left
set title "commit → entry visible in the stream (XREAD)"
plot '/work/main/bench/results/latency.dat' u 1:2 w lp t 'p50', '' u 1:3 w lp t 'p99', '' u 1:4 w lp t 'p99.9', '' u 1:5 w lp t 'max'
set title "commit → acknowledged by a consumer group (XREADGROUP + XACK)"
plot '/work/main/bench/results/latency.dat' u 1:6 w lp t 'p50', '' u 1:7 w lp t 'p99', '' u 1:8 w lp t 'p99.9', '' u 1:9 w lp t 'max'
unset multiplot
