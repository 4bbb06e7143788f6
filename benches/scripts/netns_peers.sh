#!/bin/bash
# The peers of `stack_bench --netns` on the same kind of link: two namespaces joined by a veth
# pair, client on CPU 1 and server on CPU 0 as stack_bench pins them. iperf3 (one stream) and
# ucx_perftest with UCX_TLS=tcp (tag latency and bandwidth at 8 B, 64 KiB, 1 MiB), and Open MPI's
# ob1/tcp BTL with the project's peer ping-pong (mpi_pp.c from ../shared/bench/peers, or
# MPI_PP_SRC): mpirun starts one rank in each namespace. Needs root.
set -u
A=pvpa; B=pvpb
ip netns add $A; ip netns add $B
trap 'ip netns del $A; ip netns del $B' EXIT
ip link add pvpa0 netns $A type veth peer name pvpb0 netns $B
ip -n $A addr add 10.214.0.1/24 dev pvpa0; ip -n $B addr add 10.214.0.2/24 dev pvpb0
for n in $A $B; do ip -n $n link set lo up; done
ip -n $A link set pvpa0 up; ip -n $B link set pvpb0 up
ip netns exec $B taskset -c 0 iperf3 -s -1 -D >/dev/null 2>&1; sleep 0.5
echo "== iperf3, one stream, 5 s"
ip netns exec $A taskset -c 1 iperf3 -c 10.214.0.2 -t 5 2>&1 | grep -E "sender|receiver"
for size in 8 65536 1048576; do
  for t in tag_lat tag_bw; do
    ip netns exec $B env UCX_TLS=tcp,self UCX_NET_DEVICES=pvpb0 taskset -c 0 ucx_perftest -p 13337 >/dev/null 2>&1 &
    sleep 1
    echo "== ucx_perftest UCX_TLS=tcp $t $size"
    ip netns exec $A env UCX_TLS=tcp,self UCX_NET_DEVICES=pvpa0 taskset -c 1 ucx_perftest 10.214.0.2 -p 13337 -t $t -s $size -n $([ $size -gt 65536 ] && echo 2000 || echo 20000) -w 200 2>&1 | tail -2
    wait
  done
done

src=${MPI_PP_SRC:-$(dirname "$0")/../../../shared/bench/peers/baseline_src/mpi_pp.c}
if command -v mpicc >/dev/null && [ -f "$src" ]; then
  mpicc -O2 -o /tmp/netns_mpi_pp "$src"
  echo "== Open MPI ob1/tcp, one rank per namespace (lat: one-way us; bw: GB/s)"
  mpirun --allow-run-as-root --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include 10.214.0.0/24 \
    -np 1 ip netns exec $A taskset -c 1 /tmp/netns_mpi_pp 0.5 64 : \
    -np 1 ip netns exec $B taskset -c 0 /tmp/netns_mpi_pp 0.5 64 2>&1 | grep -E "^(lat|bw) (8|65536|1048576) "
else
  echo "== Open MPI: mpicc or $src missing"
fi
