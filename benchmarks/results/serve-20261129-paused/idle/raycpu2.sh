#!/bin/bash
declare -A a
for p in $(ps -eo pid --no-headers); do a[$p]=$(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null); done
sleep $1
for p in "${!a[@]}"; do b=$(awk '{print $14+$15}' /proc/$p/stat 2>/dev/null); [ -n "$b" ] && d=$((b-${a[$p]})) && [ $d -gt 5 ] && echo "$d $(ps -o comm=,args= -p $p | cut -c1-100)"; done | sort -rn | head -20
