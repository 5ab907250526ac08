#!/usr/bin/env python3
# Which integrity checks does an S3 server verify? For each check UploadPart sends (Content-MD5,
# x-amz-checksum-crc32c, the SigV4 signed payload SHA-256, in the Authorization header or in a
# presigned URL), one small part with the right value and one with a wrong one: a server that
# checks refuses the wrong one. Run for uploads created without and with a checksum algorithm.
#   python3 bench/s3-integrity.py ENDPOINT ACCESS_KEY_ID SECRET_ACCESS_KEY [1]
# (1: only uploads created without a checksum algorithm). Makes bucket "exp" if missing.
# Signed by botocore, sent by urllib; needs boto3. Results are in BENCHMARKING.md
# ("S3 upload integrity and CPU").
import sys, hashlib, base64, urllib.request, urllib.error, struct
import boto3, botocore.config
from botocore.auth import S3SigV4Auth, S3SigV4QueryAuth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
class Given(S3SigV4Auth):
    # Signs with the X-Amz-Content-SHA256 the request carries (botocore would put the real one).
    def _modify_request_before_signing(self, request):
        given = request.headers.get('X-Amz-Content-SHA256')
        super()._modify_request_before_signing(request)
        if given:
            del request.headers['X-Amz-Content-SHA256']
            request.headers['X-Amz-Content-SHA256'] = given
ep, key, secret = sys.argv[1], sys.argv[2], sys.argv[3]
creds = Credentials(key, secret)
s3 = boto3.client("s3", endpoint_url=ep, aws_access_key_id=key, aws_secret_access_key=secret, region_name="us-east-1",
                  config=botocore.config.Config(request_checksum_calculation="when_required"))
try: s3.create_bucket(Bucket="exp")
except Exception as e: pass

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF
assert crc32c(b"123456789") == 0xE3069283
b64 = lambda d: base64.b64encode(d).decode()
body = b"ferry checks its parts" * 40
other = b"something else entirely" * 40

def put(url, headers, query_auth):
    headers = dict(headers, **{"Content-Type": "application/octet-stream"})
    req = AWSRequest(method="PUT", url=url, data=b"" if query_auth else body, headers=headers)
    if query_auth:
        S3SigV4QueryAuth(creds, "s3", "us-east-1", expires=600).add_auth(req)
    else:
        Given(creds, "s3", "us-east-1").add_auth(req)
    p = req.prepare()
    r = urllib.request.Request(p.url, data=body, method="PUT", headers=dict(p.headers))
    try:
        with urllib.request.urlopen(r) as resp:
            echo = resp.headers.get("x-amz-checksum-crc32c")
            return f"200 accepted (echoed crc32c: {echo})"
    except urllib.error.HTTPError as e:
        txt = e.read().decode(errors="replace")
        code = txt.split("<Code>")[1].split("</Code>")[0] if "<Code>" in txt else txt[:80]
        return f"{e.code} refused: {code}"

good_crc, bad_crc = b64(struct.pack(">I", crc32c(body))), b64(struct.pack(">I", crc32c(other)))
good_sha, bad_sha = hashlib.sha256(body).hexdigest(), hashlib.sha256(other).hexdigest()
good_md5, bad_md5 = b64(hashlib.md5(body).digest()), b64(hashlib.md5(other).digest())
for algo in [None, "CRC32C"][:int(sys.argv[4]) if len(sys.argv) > 4 else 2]:
    kw = {"ChecksumAlgorithm": algo} if algo else {}
    uid = s3.create_multipart_upload(Bucket="exp", Key="k", **kw)["UploadId"]
    url = f"{ep}/exp/k?partNumber=1&uploadId={uid}"
    print(f"-- upload created with checksum algorithm {algo}")
    for name, hdrs, q in [
        ("Content-MD5 right", {"Content-MD5": good_md5}, False),
        ("Content-MD5 wrong", {"Content-MD5": bad_md5}, False),
        ("crc32c right (header auth)", {"x-amz-checksum-crc32c": good_crc, "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"}, False),
        ("crc32c wrong (header auth)", {"x-amz-checksum-crc32c": bad_crc, "X-Amz-Content-SHA256": "UNSIGNED-PAYLOAD"}, False),
        ("crc32c right (presigned)", {"x-amz-checksum-crc32c": good_crc}, True),
        ("crc32c wrong (presigned)", {"x-amz-checksum-crc32c": bad_crc}, True),
        ("sha256 payload right (header auth)", {"X-Amz-Content-SHA256": good_sha}, False),
        ("sha256 payload wrong (header auth)", {"X-Amz-Content-SHA256": bad_sha}, False),
        ("sha256 payload right (presigned)", {"X-Amz-Content-SHA256": good_sha}, True),
        ("sha256 payload wrong (presigned)", {"X-Amz-Content-SHA256": bad_sha}, True),
    ]:
        print(f"{name:40} {put(url, hdrs, q)}")
    s3.abort_multipart_upload(Bucket="exp", Key="k", UploadId=uid)
