#!/usr/bin/env bash
# split_parts.sh FILE OUTDIR UNPACK : FILE cut into parts of 56 MiB, each in OUTDIR/partNN.d with an install.sh that
# gathers the parts on the host in /root/stage_<name of OUTDIR> and, once all are there, runs UNPACK in that folder
# (where `cat part*` gives FILE back). One part travels per device call (its working tree holds 64 MiB).
set -euo pipefail
file=$1 out=$2 unpack=$3
name=$(basename "$out") work=$(mktemp -d)
split -b 56m -d "$file" "$work/part"
n=$(ls "$work"/part* | wc -l)
rm -rf "$out" && mkdir -p "$out"
for p in "$work"/part*; do
  d="$out/$(basename "$p").d"; mkdir -p "$d" && mv "$p" "$d/"
  cat > "$d/install.sh" <<INS
#!/usr/bin/env bash
set -euo pipefail
mkdir -p /root/stage_$name
cp "\$(dirname "\$0")"/part* /root/stage_$name/
have=\$(ls /root/stage_$name/part* | wc -l)
if [ "\$have" -lt $n ]; then echo "staged \$have of $n parts ($name)"; exit 0; fi
cd /root/stage_$name
$unpack
INS
done
rm -rf "$work"
echo "$n parts in $out: $(du -sh "$out" | cut -f1)"
