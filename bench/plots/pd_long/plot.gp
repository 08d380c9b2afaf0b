set terminal pngcairo size 1200,900 noenhanced
set grid
set key outside right
set offsets graph 0.04, graph 0.04, graph 0.08, graph 0.04
set yrange [0:*]
set output 'bench/plots/pd_long/latency_vs_rate.png'
set multiplot layout 3,1 title 'latency vs request rate'
set xlabel 'request rate (req/s)'
set ylabel 'TTFT (ms)'
plot 'bench/plots/pd_long/rate_0.dat' using 2:3 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 1 title 'colocated long p50', '' using 2:4 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 2 title 'colocated long p99', 'bench/plots/pd_long/rate_1.dat' using 2:3 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 1 title 'pull long p50', '' using 2:4 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 2 title 'pull long p99', 'bench/plots/pd_long/rate_2.dat' using 2:3 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 1 title 'push long p50', '' using 2:4 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 2 title 'push long p99'
set ylabel 'TPOT (ms)'
plot 'bench/plots/pd_long/rate_0.dat' using 2:5 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 1 title 'colocated long p50', '' using 2:6 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 2 title 'colocated long p99', 'bench/plots/pd_long/rate_1.dat' using 2:5 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 1 title 'pull long p50', '' using 2:6 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 2 title 'pull long p99', 'bench/plots/pd_long/rate_2.dat' using 2:5 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 1 title 'push long p50', '' using 2:6 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 2 title 'push long p99'
set ylabel 'ITL (ms)'
plot 'bench/plots/pd_long/rate_0.dat' using 2:7 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 1 title 'colocated long p50', '' using 2:8 with linespoints lc rgb '#0072B2' pt 7 ps 1.3 lw 2 dt 2 title 'colocated long p99', 'bench/plots/pd_long/rate_1.dat' using 2:7 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 1 title 'pull long p50', '' using 2:8 with linespoints lc rgb '#D55E00' pt 5 ps 1.3 lw 2 dt 2 title 'pull long p99', 'bench/plots/pd_long/rate_2.dat' using 2:7 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 1 title 'push long p50', '' using 2:8 with linespoints lc rgb '#009E73' pt 9 ps 1.3 lw 2 dt 2 title 'push long p99'
unset multiplot
set output 'bench/plots/pd_long/latency_cdf.png'
set xlabel 'latency (ms)'
set ylabel 'fraction of requests'
set yrange [0:1.05]
set offsets graph 0.02, graph 0.02, 0, 0
plot 'bench/plots/pd_long/cdf_0.dat' using 1:3 with lines lc rgb '#0072B2' lw 2 dt 1 title 'colocated long @ 1 req/s TTFT', '' using 2:3 with lines lc rgb '#0072B2' lw 2 dt 2 title 'colocated long @ 1 req/s E2EL', 'bench/plots/pd_long/cdf_1.dat' using 1:3 with lines lc rgb '#0072B2' lw 2 dt 1 title 'colocated long @ 2 req/s TTFT', '' using 2:3 with lines lc rgb '#0072B2' lw 2 dt 2 title 'colocated long @ 2 req/s E2EL', 'bench/plots/pd_long/cdf_2.dat' using 1:3 with lines lc rgb '#D55E00' lw 2 dt 1 title 'pull long @ 1 req/s TTFT', '' using 2:3 with lines lc rgb '#D55E00' lw 2 dt 2 title 'pull long @ 1 req/s E2EL', 'bench/plots/pd_long/cdf_3.dat' using 1:3 with lines lc rgb '#D55E00' lw 2 dt 1 title 'pull long @ 2 req/s TTFT', '' using 2:3 with lines lc rgb '#D55E00' lw 2 dt 2 title 'pull long @ 2 req/s E2EL', 'bench/plots/pd_long/cdf_4.dat' using 1:3 with lines lc rgb '#009E73' lw 2 dt 1 title 'push long @ 1 req/s TTFT', '' using 2:3 with lines lc rgb '#009E73' lw 2 dt 2 title 'push long @ 1 req/s E2EL', 'bench/plots/pd_long/cdf_5.dat' using 1:3 with lines lc rgb '#009E73' lw 2 dt 1 title 'push long @ 2 req/s TTFT', '' using 2:3 with lines lc rgb '#009E73' lw 2 dt 2 title 'push long @ 2 req/s E2EL'
