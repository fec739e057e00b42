set terminal pngcairo size 1000,1400 font ',9'
set output '/work/main/bench/results/soak.png'
set multiplot layout 5,1 title 'outbox-relay soak: 2000 msg/s over 4 topics for 30 min (grey: group "lagger" stopped)'
set xlabel 'minutes'
set grid
set object 1 rect from 10.0,graph 0 to 20.0,graph 1 fc rgb '#eeeeee' behind
set ylabel 'MiB'
plot '/work/main/bench/results/soak.dat' u 1:2 w l lw 2 t 'outbox.messages, table + indexes'
set ylabel 'ms'
plot '/work/main/bench/results/soak.dat' u 1:3 w lp pt 7 ps 0.4 t 'claim of 500 rows'
set ylabel 'ms'
set yrange [0:*]
plot '/work/main/bench/results/soak-windows.dat' u 1:2 w lp pt 7 ps 0.4 t 'commit -> stream p99 (per window)', '/work/main/bench/results/soak-windows.dat' u 1:3 w l lc rgb '#999999' t 'commit -> read by a consumer, p99', 50.0 w l dt 2 t 'target'
unset yrange
set ylabel 'MiB'
plot '/work/main/bench/results/soak.dat' u 1:4 w l lw 2 t 'Redis used memory'
set ylabel 'entries'
plot '/work/main/bench/results/soak.dat' u 1:5 w l lw 2 t 'entries in the 4 streams'
unset multiplot
