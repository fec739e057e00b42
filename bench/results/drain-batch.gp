
set terminal pngcairo size 800,480 font ",10"
set output '/work/main/bench/results/drain-batch.png'
set title "outbox-relay: drain throughput against batch size (80,000-row backlog, dedup on)"
set logscale x
set xlabel "batch size (rows per claim)"
set ylabel "messages per second"
set yrange [0:*]
set grid
set key bottom right
plot '/work/main/bench/results/drain-batch.dat' u 1:2 w lp lw 2 t 'relay', '' u 1:3 w lp lw 2 t 'naive loop', 139576.1 w l dt 2 t 'claim+finish alone (batch 500)', 109740.8 w l dt 3 t 'publish alone (calls of 64)'
