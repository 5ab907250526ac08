#!/usr/bin/env bash
# ferry and its peers reading images over HTTP(S), side by side in one run. One nginx on
# loopback (HTTP, and HTTPS with a throwaway CA made by openssl) serves SIZE_G GiB of
# AES-CTR bytes (data.raw) and a qcow2 made from it by qemu-img (data.qcow2), from
# HTTP_DIR (default /var/tmp). Each row: medians of 3 rounds, the tools alternating.
#   to null:    ferry copy URL null:  vs  nbdkit curl URL --run 'nbdcopy "$uri" null:'
#               vs curl -s -o /dev/null URL  vs  wget -q -O /dev/null URL
#   qcow2->raw: ferry copy URL out.raw  vs  qemu-img convert -f qcow2 -O raw json:{http} out.raw
#   HTTPS:      ferry copy --ca CA URL null:  vs  curl --cacert CA -s -o /dev/null URL
# The ratios are the peer's time over ferry's (above 1: ferry is faster).
# Needs nginx, nbdkit (its curl plugin), libnbd-bin, curl, wget, and qemu's curl driver:
# qemu-block-extra from bookworm-backports (installed below when missing; the plain
# bookworm one would replace qemu-utils 10 with 7.2).
# Run from the project root after `cargo build --release -p ferry`.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/lib.sh"
FERRY=${FERRY:-$PWD/target/release/ferry}
SIZE_G=${SIZE_G:-4}

# ---- tools ---------------------------------------------------------------------------
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
missing=()
[ -x /usr/sbin/nginx ] || missing+=(nginx)
command -v nbdkit >/dev/null && [ -n "$(nbdkit curl --version 2>/dev/null)" ] || missing+=(nbdkit nbdkit-plugin-curl)
command -v nbdcopy >/dev/null || missing+=(libnbd-bin)
command -v curl >/dev/null || missing+=(curl)
command -v wget >/dev/null || missing+=(wget)
if ((${#missing[@]})); then
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! ls /usr/lib/*/qemu/block-curl.so >/dev/null 2>&1; then
  # The mirror of the system's own Debian sources (one-line or deb822): no host is named here.
  mirror=$(grep -rhE '^[^#]*https?://' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null |
    grep -oE 'https?://[^ ]+/debian/?' | grep -v security | head -1)
  if [ -z "$mirror" ]; then
    echo "bench/http.sh: qemu's curl driver (qemu-block-extra from bookworm-backports) is missing, and no" >&2
    echo "Debian mirror was found in /etc/apt/sources.list{,.d/} to add bookworm-backports from." >&2
    echo "Install qemu-block-extra yourself (a version matching qemu-utils), then run this again." >&2
    exit 1
  fi
  echo "deb $mirror bookworm-backports main" |
    $SUDO tee /etc/apt/sources.list.d/bookworm-backports.list >/dev/null
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -t bookworm-backports qemu-block-extra >/dev/null
fi

# ---- images and nginx ------------------------------------------------------------------
W=$(mktemp -d "${HTTP_DIR:-/var/tmp}/ferry-http.XXXX") || exit 1
cleanup() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$W"; }
trap cleanup EXIT
mkdir -p "$W/data" "$W/tmp" "$W/logs"
openssl enc -aes-128-ctr -pass pass:http -nosalt -pbkdf2 </dev/zero 2>/dev/null | head -c $((SIZE_G << 30)) >"$W/data/data.raw"
qemu-img convert -f raw -O qcow2 "$W/data/data.raw" "$W/data/data.qcow2"
ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${ec[@]}" -keyout "$W/ca.key" -out "$W/ca.pem" -days 2 -subj "/CN=ferry bench CA" 2>/dev/null
openssl req "${ec[@]}" -keyout "$W/srv.key" -out "$W/srv.csr" -subj /CN=127.0.0.1 2>/dev/null
echo "subjectAltName=IP:127.0.0.1" >"$W/ext"
openssl x509 -req -in "$W/srv.csr" -CA "$W/ca.pem" -CAkey "$W/ca.key" -CAcreateserial -out "$W/srv.pem" \
  -days 2 -extfile "$W/ext" 2>/dev/null
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(free_port); PS=$(free_port)
cat >"$W/nginx.conf" <<EOF
$([ "$(id -u)" = 0 ] && echo "user root;")
worker_processes 2;
pid $W/nginx.pid;
error_log $W/logs/error.log;
events { worker_connections 512; }
http {
    default_type application/octet-stream;
    access_log off;
    client_body_temp_path $W/tmp/body;
    proxy_temp_path $W/tmp/proxy;
    fastcgi_temp_path $W/tmp/fastcgi;
    uwsgi_temp_path $W/tmp/uwsgi;
    scgi_temp_path $W/tmp/scgi;
    sendfile on;
    keepalive_requests 1000000;
    server {
        listen 127.0.0.1:$P;
        listen 127.0.0.1:$PS ssl;
        ssl_certificate $W/srv.pem;
        ssl_certificate_key $W/srv.key;
        root $W/data;
    }
}
EOF
/usr/sbin/nginx -c "$W/nginx.conf" -p "$W" -g 'daemon off;' &
wait_port "$P"
RAW=http://127.0.0.1:$P/data.raw
QCOW2=http://127.0.0.1:$P/data.qcow2
RAWS=https://127.0.0.1:$PS/data.raw
# Both files in the page cache, as a busy server would have them.
cat "$W/data/data.raw" "$W/data/data.qcow2" >/dev/null

echo "# $(date -u '+%Y-%m-%d %H:%M UTC'), SIZE_G=$SIZE_G, $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# $("$FERRY" --version), $(nginx -v 2>&1 | cut -d' ' -f3), $(nbdkit --version), $(nbdcopy --version | head -1),"
echo "# $(curl --version | head -1 | cut -d' ' -f1-2), $(wget --version | head -1 | cut -d' ' -f1-3), $(qemu-img --version | head -1)"

declare -A T
# run_rounds NAME... : 3 rounds, the order rotating; each NAME is a function run by secs.
run_rounds() {
  local order=("$@") round n
  for round in 1 2 3; do
    for n in "${order[@]}"; do
      T[$n]+="$(secs "$n") "
      rm -f "$W/out.raw"
    done
    order=("${order[@]:1}" "${order[0]}")
  done
}
median() { echo ${T[$1]} | tr ' ' '\n' | grep -v FAIL | med; }
mbs() { printf "%.0f" "$(echo "($SIZE_G * 1073741824) / $1 / 1000000" | bc -l)"; }
# table TITLE REF NAME=LABEL...: seconds, MB/s, and the peer's time over REF's.
table() {
  local title=$1 ref=$2 t r e n label
  shift 2
  r=$(median "$ref")
  echo
  echo "| $title | seconds | MB/s | peer time / ferry time |"
  echo "|---|---|---|---|"
  for e in "$@"; do
    n=${e%%=*}; label=${e#*=}
    t=$(median "$n")
    if [ -z "$t" ]; then echo "| $label | fail | | |"; continue; fi
    printf "| %s | %.2f | %s | %s |\n" "$label" "$t" "$(mbs "$t")" \
      "$([ "$n" = "$ref" ] || [ -z "$r" ] && echo - || printf "%.2f" "$(echo "$t / $r" | bc -l)")"
  done
}

# ---- to null: --------------------------------------------------------------------------
ferry_null() { "$FERRY" copy -q "$RAW" null:; }
nbdkit_null() { nbdkit -U - curl "$RAW" --run 'nbdcopy "$uri" null:'; }
curl_null() { curl -sf -o /dev/null "$RAW"; }
wget_null() { wget -q -O /dev/null "$RAW"; }
run_rounds ferry_null nbdkit_null curl_null wget_null
table "$SIZE_G GiB raw over HTTP to null:" ferry_null \
  "ferry_null=ferry copy URL null:" \
  "nbdkit_null=nbdkit curl URL --run 'nbdcopy \"\$uri\" null:'" \
  "curl_null=curl -s -o /dev/null URL" \
  "wget_null=wget -q -O /dev/null URL"

# ---- qcow2 over HTTP to a raw file -----------------------------------------------------------
ferry_q() { "$FERRY" copy -q "$QCOW2" "$W/out.raw"; }
# qemu's curl driver stalls with more than one coroutine (qemu-img's default -m 8: a
# 256 MiB image did not finish in 120 s, with -m 2 in 60 s), so it runs with -m 1; one
# timed attempt at the default is reported below the table.
QJSON="json:{\"file\":{\"driver\":\"http\",\"url\":\"$QCOW2\"}}"
qemu_q() { qemu-img convert -m 1 -f qcow2 -O raw "$QJSON" "$W/out.raw"; }
qemu_q8() { timeout "${QEMU_M8_LIMIT:-60}" qemu-img convert -f qcow2 -O raw "$QJSON" "$W/out.raw"; }
# One checked run first: both give the raw bytes.
ferry_q && cmp -s "$W/out.raw" "$W/data/data.raw" || echo "# WARNING: ferry's copy of $QCOW2 differs from data.raw"
qemu_q && cmp -s "$W/out.raw" "$W/data/data.raw" || echo "# WARNING: qemu-img's copy of $QCOW2 differs from data.raw"
rm -f "$W/out.raw"
run_rounds ferry_q qemu_q
table "$SIZE_G GiB qcow2 over HTTP to a raw file in ${HTTP_DIR:-/var/tmp}" ferry_q \
  "ferry_q=ferry copy URL out.raw" \
  "qemu_q=qemu-img convert -m 1 -f qcow2 -O raw 'json:{\"file\":{\"driver\":\"http\",\"url\":URL}}' out.raw"
t=$(secs qemu_q8); rm -f "$W/out.raw"
echo
echo "qemu-img convert at its default -m 8, one run: $([ "$t" = FAIL ] && echo "did not finish within ${QEMU_M8_LIMIT:-60} s" || printf "%.2f s" "$t")"

# ---- HTTPS -----------------------------------------------------------------------------------
ferry_s() { "$FERRY" copy -q --ca "$W/ca.pem" "$RAWS" null:; }
curl_s() { curl -sf --cacert "$W/ca.pem" -o /dev/null "$RAWS"; }
wget_s() { wget -q --ca-certificate="$W/ca.pem" -O /dev/null "$RAWS"; }
run_rounds ferry_s curl_s wget_s
table "$SIZE_G GiB raw over HTTPS to null:" ferry_s \
  "ferry_s=ferry copy --ca CA URL null:" \
  "curl_s=curl --cacert CA -s -o /dev/null URL" \
  "wget_s=wget -q --ca-certificate=CA -O /dev/null URL"
