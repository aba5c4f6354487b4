# sh verify-receipt.sh ANSWER.json SERVER-KEY.pem: jq, xxd and openssl only
set -e
jq '.receipt // .' "$1" > receipt.json
for part in . .tree_head; do
  jq "$part | del(.signature)" receipt.json | jq -j -f "$(dirname "$0")/jcs.jq" > signed.bin
  jq -j "$part | .signature" receipt.json | xxd -r -p > signature.bin
  openssl pkeyutl -verify -pubin -inkey "$2" -rawin -in signed.bin -sigfile signature.bin
done
