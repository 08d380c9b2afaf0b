set terminal pngcairo size 900,600 noenhanced
set grid
set key outside right
set output 'bench/plots/pd_mixed/latency_vs_rate.png'
set multiplot layout 3,1 title 'latency vs request rate'
set xlabel 'request rate (req/s)'
set ylabel 'TTFT (ms)'
plot 'bench/plots/pd_mixed/latency_vs_rate.dat' using 2:3 with linespoints title 'p50', '' using 2:4 with linespoints title 'p99'
set ylabel 'TPOT (ms)'
plot 'bench/plots/pd_mixed/latency_vs_rate.dat' using 2:5 with linespoints title 'p50', '' using 2:6 with linespoints title 'p99'
set ylabel 'ITL (ms)'
plot 'bench/plots/pd_mixed/latency_vs_rate.dat' using 2:7 with linespoints title 'p50', '' using 2:8 with linespoints title 'p99'
unset multiplot
set output 'bench/plots/pd_mixed/latency_cdf.png'
set xlabel 'latency (ms)'
set ylabel 'fraction of requests'
plot 'bench/plots/pd_mixed/cdf_0.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/colocated-mixed-1.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/colocated-mixed-1.json E2EL', 'bench/plots/pd_mixed/cdf_1.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/colocated-mixed-2.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/colocated-mixed-2.json E2EL', 'bench/plots/pd_mixed/cdf_2.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/pull-mixed-1.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/pull-mixed-1.json E2EL', 'bench/plots/pd_mixed/cdf_3.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/pull-mixed-2.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/pull-mixed-2.json E2EL', 'bench/plots/pd_mixed/cdf_4.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/push-mixed-1.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/push-mixed-1.json E2EL', 'bench/plots/pd_mixed/cdf_5.dat' using 1:3 with lines title '/tmp/pd-bench-5HFP9T/push-mixed-2.json TTFT', '' using 2:3 with lines title '/tmp/pd-bench-5HFP9T/push-mixed-2.json E2EL'
