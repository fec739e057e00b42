
set terminal pngcairo size 800,480 font ",10"
set output '/work/main/bench/results/producers.png'
set title "producer transactions per second (pgbench, one-row INSERT), relay running"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel "transactions per second"
set xlabel "concurrent producers, synchronous_commit" noenhanced
set yrange [0:*]
set grid ytics
set key top left
plot '/work/main/bench/results/producers.dat' u 2:xtic(1) t 'with wake-up trigger', '' u 3 t 'trigger dropped'
